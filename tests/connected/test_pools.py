"""Deployment pools (streams/pools.py) through real processes: a routed request
is pulled only by workers of its candidate deployments (no hand-backs), a
retryable failure falls back to the next candidate's pool, a candidate with no
live worker is skipped, and one scaled to zero is served once a worker comes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet, FleetSpec
from streams.auth import Role
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.depth import consumer_infos
from tests.refusals import checked_fleet
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]

ROUTES = ("r-only-b", "r-fallback", "r-skip", "r-cold", "r-laned")
LONG_SYSTEM = "You are the assistant of a large shop; answer briefly and politely. " * 8


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    aliases = [arg for name in ROUTES for arg in ("--alias", name)]
    spec = FleetSpec(workers=0, profile="fast", engine_per_worker=True, sim_args=aliases)
    with checked_fleet(request, spec) as f:
        f.start_worker("--deployment-name", "dep-a")  # worker 0
        f.start_worker("--deployment-name", "dep-b")  # worker 1
        # Every answer of this engine is a 503: a candidate that always fails.
        f.start_worker("--deployment-name", "dep-bad", sim_args=["--fault-rate", "503=1.0"])
        yield f


def contract(name: str, *deps: str, **over: Any) -> dict[str, Any]:
    cands = [
        {"name": d, "adapter": "openai", "engine": "jetserve-sim", "model": name} for d in deps
    ]
    return {"name": name, "candidates": cands, **over}


async def apply(fleet: Fleet, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(
        base_url=fleet.admin_url, headers={"Authorization": f"Bearer {fleet.admin_token}"}
    ) as c:
        r = await c.put(f"/admin/routes/{body['name']}", json=body)
        assert r.status_code in (200, 201), r.text


async def chat(c: httpx.AsyncClient, fleet: Fleet, model: str, system: str = "") -> str:
    messages = [{"role": "system", "content": system}] if system else []
    r = await c.post(
        f"{fleet.base_url}/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": 4,
            "messages": [*messages, {"role": "user", "content": "hi"}],
        },
        headers={"Authorization": f"Bearer {fleet.api_key}"},
    )
    assert r.status_code == 200, r.text
    return str(r.headers["x-request-id"])


def records(fleet: Fleet, route: str) -> list[dict[str, Any]]:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    return [r for r in map(json.loads, text.splitlines()) if r["route"] == route]


async def worker_metric(
    c: httpx.AsyncClient, fleet: Fleet, n: int, name: str, **labels: str
) -> float:
    text = (await c.get(f"http://127.0.0.1:{fleet.worker_metrics_ports[n]}/metrics")).text
    return metric_sum(text, name, **labels)


async def pool_deliveries(fleet: Fleet) -> dict[str, int]:
    """Deliveries so far per deployment pool (its plain and lane consumers)."""
    nc = await connect(fleet.nats_url, "test-pools", fleet.bus_auth(Role.ADMIN))
    try:
        infos = await consumer_infos(nc.jetstream(), DEFAULT_TOPOLOGY.stream)
    finally:
        await nc.close()
    out: dict[str, int] = {}
    for info in infos:
        if info.name.startswith("pool-"):
            pool = info.name.removeprefix("pool-").rsplit("-", 2 if "-l" in info.name else 1)[0]
            done = info.delivered.consumer_seq if info.delivered else 0
            out[pool] = out.get(pool, 0) + (done or 0)
    return out


async def pools_seen(fleet: Fleet, *deps: str) -> None:
    """Until the gateway's members view has a live worker in each of ``deps``."""

    async def seen() -> bool:
        async with httpx.AsyncClient() as c:
            text = (await c.get(fleet.gateway_metrics_urls[0])).text
        return all(
            metric_sum(text, "jetserve_gateway_pool_workers", deployment=d) >= 1 for d in deps
        )

    await until(seen, f"the gateway seeing workers of {deps}")


async def test_a_routed_request_reaches_only_its_candidates(fleet: Fleet) -> None:
    await apply(fleet, contract("r-only-b", "dep-b"))
    await apply(fleet, contract("r-laned", "dep-a"))
    async with httpx.AsyncClient(timeout=30) as c:
        await asyncio.gather(*(chat(c, fleet, "r-only-b") for _ in range(12)))
        # Long shared prompts take the pool's own lanes.
        await asyncio.gather(*(chat(c, fleet, "r-laned", LONG_SYSTEM) for _ in range(6)))
        assert {r["deployment"] for r in records(fleet, "r-only-b")} == {"dep-b"}
        assert {r["deployment"] for r in records(fleet, "r-laned")} == {"dep-a"}
        assert {r["attempts"] for r in records(fleet, "r-only-b")} == {1}
        # No worker outside the candidates ever saw one: nothing handed back.
        for n in range(3):
            handed = await worker_metric(
                c, fleet, n, "jetserve_worker_redeliveries_total", reason="not_candidate"
            )
            assert handed == 0, n
    delivered = await pool_deliveries(fleet)
    assert delivered["dep-b"] == 12
    assert delivered["dep-a"] == 6
    assert delivered.get("dep-bad", 0) == 0
    nc = await connect(fleet.nats_url, "test-pools", fleet.bus_auth(Role.ADMIN))
    try:
        infos = await consumer_infos(nc.jetstream(), DEFAULT_TOPOLOGY.stream)
    finally:
        await nc.close()
    laned = sum(
        (i.delivered.consumer_seq or 0)
        for i in infos
        if i.name.startswith("pool-dep-a-interactive-l") and i.delivered
    )
    assert laned == 6


async def test_a_failing_candidate_falls_back_to_the_next_pool(fleet: Fleet) -> None:
    await apply(fleet, contract("r-fallback", "dep-bad", "dep-b"))
    await pools_seen(fleet, "dep-bad", "dep-b")
    async with httpx.AsyncClient(timeout=30) as c:
        await asyncio.gather(*(chat(c, fleet, "r-fallback") for _ in range(4)))
        rows = records(fleet, "r-fallback")
        assert len(rows) == 4
        # Each went to dep-bad first (the first live candidate), failed with a
        # 503 before any token, and was handed to dep-b's pool.
        assert {r["deployment"] for r in rows} == {"dep-b"}
        assert all(r["attempts"] >= 2 for r in rows), rows
        fell_back = await worker_metric(
            c, fleet, 2, "jetserve_worker_redeliveries_total", reason="fallback"
        )
        assert fell_back == 4


async def test_a_candidate_without_workers_is_skipped_and_a_cold_pool_waits(
    fleet: Fleet,
) -> None:
    await apply(fleet, contract("r-skip", "dep-none", "dep-a"))
    await apply(fleet, contract("r-cold", "dep-cold"))
    await pools_seen(fleet, "dep-a")
    async with httpx.AsyncClient(timeout=60) as c:
        await chat(c, fleet, "r-skip")
        (row,) = records(fleet, "r-skip")
        assert (row["deployment"], row["attempts"]) == ("dep-a", 1)

        # No worker serves dep-cold: the request waits in its pool, counted in the
        # pool's own queue depth (what scales the pool up from zero), not in the
        # class's: only dep-cold's workers can take it, so it must neither hold
        # back (fair gate, shedding) nor scale the class's shared workers ...
        waiting = asyncio.create_task(chat(c, fleet, "r-cold"))
        depths: list[tuple[float, float]] = []

        async def queued() -> bool:
            text = (await c.get(fleet.gateway_metrics_urls[0])).text
            pool = metric_sum(
                text, "jetserve_pool_queue_depth", cls="interactive", deployment="dep-cold"
            )
            depths.append((pool, metric_sum(text, "jetserve_queue_depth", cls="interactive")))
            return pool >= 1

        await until(queued, "the cold pool's request in the pool's queue depth")
        assert depths[-1][1] == 0, depths  # the class's shared queue: empty
        # An operator's reading for dep-cold's workers counts it; the shared one not.
        assert fleet.creds is not None
        env = {**os.environ, "JETSERVE_NATS_SEED_FILE": str(fleet.creds.seed_file(Role.ADMIN))}

        def lag(*extra: str) -> int:
            argv = [sys.executable, "-m", "jetserve", "scale", "--json", "--nats", fleet.nats_url]
            done = subprocess.run(
                [*argv, "--classes", "interactive", *extra],
                capture_output=True, text=True, timeout=30, env=env, check=True,
            )  # fmt: skip
            (row,) = json.loads(done.stdout)["classes"]
            return int(row["lag"])

        assert await asyncio.to_thread(lag, "--deployment", "dep-cold") >= 1
        assert await asyncio.to_thread(lag) == 0
        assert not waiting.done()
        # ... until one comes.
        await asyncio.to_thread(fleet.start_worker, "--deployment-name", "dep-cold", wait=False)
        await waiting
        (row,) = records(fleet, "r-cold")
        assert row["deployment"] == "dep-cold"

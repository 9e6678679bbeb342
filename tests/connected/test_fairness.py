"""Tenants in turn within a class, through real processes (gateway/inference/
fair_gate.py): while one tenant keeps the class saturated, another tenant's
request goes ahead of the flood's queue instead of behind it: the flood's
excess waits at the gateway, then in the class's excess subject, and the other
tenant's request, in turn, goes to the class's own subject, whose puller is
ready for it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]

FLOOD_CLIENTS = 24


def body(text: str) -> dict[str, object]:
    return {"model": "sim-8b", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}


async def test_a_second_tenant_is_served_ahead_of_a_flood(
    make_fleet: Callable[..., Fleet],
) -> None:
    # One engine serving one request at a time, ~0.1 s each: a closed loop of
    # 24 clients keeps a queue ~24 deep.
    fleet = make_fleet(
        workers=1, sim_args=["--max-num-seqs", "1"], worker_args=["--max-inflight", "1"]
    )
    with fleet.admin() as admin:
        admin.create_tenant("flood")
        flood_key = admin.create_key("flood", "k")["api_key"]
        # A lighter share for the flood: its turns come half as often.
        admin.set_limits("tenant", "flood", rpm=1_000_000, weight=0.5)
        assert admin.get_limits("tenant", "flood")["weight"] == 0.5
    url = f"{fleet.base_url}/v1/chat/completions"
    slow = {"X-Sim-Fault": "slow:12", "X-Jetserve-Timeout": "60"}
    flood_done: list[float] = []
    stop = asyncio.Event()
    warm = asyncio.Event()  # the flood has been going a while

    async def flood(c: httpx.AsyncClient, n: int) -> None:
        headers = {"Authorization": f"Bearer {flood_key}", **slow}
        i = 0
        while not stop.is_set():
            r = await c.post(url, json=body(f"flood {n}.{i}"), headers=headers)
            assert r.status_code == 200, r.text
            flood_done.append(time.monotonic())
            if len(flood_done) >= 3 * FLOOD_CLIENTS:
                warm.set()
            i += 1

    headers = {"Authorization": f"Bearer {fleet.api_key}", **slow}
    async with httpx.AsyncClient(timeout=90) as c:
        # The other tenant is around in the class (it sent a request before).
        r = await c.post(url, json=body("the other tenant, first"), headers=headers)
        assert r.status_code == 200, r.text
        floods = [asyncio.create_task(flood(c, n)) for n in range(FLOOD_CLIENTS)]
        # Past the first burst (which the gate lets through while the queue looked
        # empty): the flood is now held at the gateway, in its tenant's queue.
        await asyncio.wait_for(warm.wait(), 60)
        sent = time.monotonic()
        r = await c.post(url, json=body("the other tenant"), headers=headers)
        done = time.monotonic()
        stop.set()
        await asyncio.gather(*floods)
        metrics_url = f"http://127.0.0.1:{fleet.gateway_metrics_ports[0]}/metrics"
        metrics = (await c.get(metrics_url)).text
    assert r.status_code == 200, r.text
    # Flood requests served while the other tenant's one waited: the queue ahead of
    # it. First come, first served, that is the whole flood (~24); in turn, at most
    # the one running in the engine (one sequence at a time, and the excess may run
    # beside the in-turn puller's slot: the engine queues one). Told by when the
    # gateway took the request in and the engine began each answer, not by when
    # this client's loop took answers in: loaded, it took them late, and flood
    # answers that came before the other tenant's request were counted after it.
    other_id = r.headers["x-request-id"]
    other, floods_served = await _served(fleet, other_id, len(flood_done))
    ahead = sum(1 for t in floods_served if other[0] < t < other[1])
    client_side = sum(1 for t in flood_done if sent < t < done)
    print(f"\nahead of the other tenant: {ahead} (the client's clock says {client_side})")
    assert ahead <= 2, ahead
    passes = {
        line.split('way="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("jetserve_gateway_fair_passes_total{") and 'cls="interactive"' in line
    }
    assert passes.get("excess", 0) >= FLOOD_CLIENTS, passes  # the flood went apart
    assert passes.get("in_turn", 0) >= 1, passes  # the other tenant's, at once


def _ledger(fleet: Fleet, tenant: str) -> list[dict[str, object]]:
    with fleet.admin() as admin:
        text = admin.ledger(tenant)
    return [msgspec.json.decode(line) for line in text.splitlines() if line]


async def _served(
    fleet: Fleet, other_id: str, floods: int
) -> tuple[tuple[float, float], list[float]]:
    """The other tenant's request (arrived at the gateway, first token) and each
    flood request's first token, by this machine's wall clock: the arrival is the
    ledger record's ``created``, a first token the engine's own record (the
    ledger's ``first_token_ms`` counts from after the fair gate's hold, so a held
    flood request would look served before it was)."""
    other: list[dict[str, object]] = []
    flood: list[dict[str, object]] = []

    async def recorded() -> bool:
        mine = await asyncio.to_thread(_ledger, fleet, fleet.spec.tenant)
        other[:] = [x for x in mine if x["request_id"] == other_id]
        flood[:] = [
            x for x in await asyncio.to_thread(_ledger, fleet, "flood") if x["status"] == 200
        ]
        return bool(other) and len(flood) >= floods

    await until(recorded, "the other tenant's and the flood's records")
    async with httpx.AsyncClient(timeout=30) as c:

        async def first_token(request_id: object) -> float:
            r = await c.get(f"{fleet.sim_url}/sim/requests/{request_id}")
            assert r.status_code == 200, r.text
            at = r.json()["first_token_at"]
            assert at is not None, request_id
            return float(at)

        (one,) = other
        arrived = float(one["created"])  # type: ignore[arg-type]
        return (arrived, await first_token(one["request_id"])), [
            await first_token(f["request_id"]) for f in flood
        ]


async def test_a_client_that_leaves_while_held_for_its_turn_is_never_published(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Patient clients keep the class backed up, so the gate holds the tenant's
    requests; impatient ones give up after 0.3 s, while held. Their requests leave
    the gate unpublished, recorded as refused 499 (they used to wait on for their
    turn, be published, then be cancelled at once by id)."""
    fleet = make_fleet(
        workers=1, sim_args=["--max-num-seqs", "1"], worker_args=["--max-inflight", "1"]
    )
    url = f"{fleet.base_url}/v1/chat/completions"
    headers = {
        "Authorization": f"Bearer {fleet.api_key}",
        "X-Sim-Fault": "slow:12",
        "X-Jetserve-Timeout": "60",
    }
    metrics_url = f"http://127.0.0.1:{fleet.gateway_metrics_ports[0]}/metrics"
    stop = asyncio.Event()

    async def patient(c: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not stop.is_set():
            r = await c.post(url, json=body(f"patient {n}.{i}"), headers=headers)
            assert r.status_code == 200, r.text
            i += 1

    async def impatient(n: int) -> None:
        async with httpx.AsyncClient(timeout=0.3) as c:
            i = 0
            while not stop.is_set():
                # Gone after 0.3 s: what it leaves behind is the point.
                with contextlib.suppress(httpx.TimeoutException):
                    await c.post(url, json=body(f"impatient {n}.{i}"), headers=headers)
                i += 1

    def left(metrics: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("jetserve_gateway_fair_passes_total{") and 'way="left"' in line
        )

    async with httpx.AsyncClient(timeout=90) as c:
        clients = [asyncio.create_task(patient(c, n)) for n in range(FLOOD_CLIENTS)]
        clients += [asyncio.create_task(impatient(n)) for n in range(4)]

        async def three_left() -> bool:
            return left((await c.get(metrics_url)).text) >= 3

        await until(three_left, "clients leaving while held by the gate", bound_s=120, every_s=0.2)
        stop.set()
        await asyncio.gather(*clients)
    with fleet.admin() as admin:
        rows = [msgspec.json.decode(x) for x in admin.ledger(fleet.spec.tenant).splitlines() if x]
    held_and_left = [r for r in rows if r["policy"] == "rejected:client_disconnected"]
    assert len(held_and_left) >= 3, [r["policy"] for r in rows][-20:]
    assert {r["status"] for r in held_and_left} == {499}

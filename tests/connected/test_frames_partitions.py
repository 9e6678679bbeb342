"""The frames capture in four streams by a hash of the request id (docs/scale.md,
item 1), through real NATS: provisioning records the count and the first gateway's
wins; each request's frames land in its partition's stream; a stream resumes with
Last-Event-ID on another replica, never for another tenant; the agent's credential
reads a request back from its partition (the model-call recovery path) and an agent
run's model calls are captured there; and the orphan sweep settles a killed
gateway's streams from their partitions."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from nats.js.errors import NotFoundError

from jetserve.fleet import Fleet, FleetSpec
from jetserve.services import Service
from streams.agent import model_request_id
from streams.auth import Role
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY, Topology
from streams.inference.client import InferenceClient
from streams.provision import await_topology, ensure_topology
from streams.subjects import frames_partition
from tests.connected.test_resume import BODY, read_events, reference
from tests.refusals import checked_fleet
from tests.waits import until

pytestmark = pytest.mark.connected

P = 4


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    # A client that disconnects has 5 s to resume before its request is cancelled.
    spec = FleetSpec(
        gateways=2,
        workers=1,
        agents=1,
        frames_partitions=P,
        gateway_args=["--resume-grace", "5"],
    )
    with checked_fleet(request, spec) as f:
        yield f


async def _topology(fleet: Fleet, role: Role = Role.ADMIN) -> tuple[Any, Topology]:
    """A connection as ``role`` and the topology the fleet's stream records."""
    nc = await fleet.connect(role=role)
    topo = await await_topology(nc.jetstream(), DEFAULT_TOPOLOGY, consumers=False)
    return nc, topo


async def _held_by(js: Any, topo: Topology, tenant: str, request_id: str) -> dict[str, int]:
    """Messages of one request in each capture stream, by stream name."""
    out = {}
    for name in topo.frames_streams:
        info = await js.stream_info(name, subjects_filter=f"jetserve.reply.{tenant}.>")
        subjects = info.state.subjects or {}
        out[name] = sum(n for s, n in subjects.items() if s.endswith(f".{request_id}"))
    return out


async def test_provisioning_records_the_count_and_the_first_gateway_wins(
    nats_server: Service, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    gw = await connect(url, "gw", nats_server.bus_auth(Role.GATEWAY))
    agent = await connect(url, "agent", nats_server.bus_auth(Role.AGENT))
    try:
        js = gw.jetstream()
        first = await ensure_topology(js, Topology(lanes=16, frames_partitions=P))
        assert first.frames_partitions == P
        for n in range(P):
            info = await js.stream_info(f"JETSERVE_FRAMES_{n}")
            assert info.config.subjects == [f"jetserve.reply.*.p{n}.*.*"]
            assert info.config.max_bytes == DEFAULT_TOPOLOGY.frames.max_bytes  # per stream
        with pytest.raises(NotFoundError):
            await js.stream_info("JETSERVE_FRAMES")
        with caplog.at_level(logging.WARNING, logger="streams.provision"):
            second = await ensure_topology(js, Topology(lanes=16, frames_partitions=2))
        assert second.frames_partitions == P
        assert "records 4 frames partitions, not the configured 2" in caplog.text
        # An executor configured with none takes the fleet's (its own credential).
        found = await await_topology(agent.jetstream(), Topology(), consumers=False)
        assert found.frames_partitions == P
        assert (await agent.jetstream().stream_info("JETSERVE_FRAMES_3")).config.name
    finally:
        await gw.close()
        await agent.close()


async def test_each_request_is_captured_in_its_partition_stream(fleet: Fleet) -> None:
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    body = {**BODY, "stream": False, "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as c:
        answers = await asyncio.gather(
            *(
                c.post(f"{fleet.base_url}/v1/chat/completions", json=body, headers=headers)
                for _ in range(12)
            )
        )
    assert [r.status_code for r in answers] == [200] * 12
    ids = [r.headers["x-request-id"] for r in answers]
    nc, topo = await _topology(fleet)
    try:
        js = nc.jetstream()
        assert topo.frames_partitions == P
        for rid in ids:
            held = await _held_by(js, topo, fleet.spec.tenant, rid)
            mine = topo.frames_stream_of(rid)
            assert held[mine] >= 2, (rid, held)  # meta and final at least
            assert not {k: v for k, v in held.items() if k != mine and v}, (rid, held)
        used = {topo.frames_stream_of(rid) for rid in ids}
        assert len(used) >= 2, used  # 12 ids in one partition of 4: ~1e-7
        for name in used:
            assert (await js.stream_info(name)).state.messages > 0
        with pytest.raises(NotFoundError):
            await js.stream_info("JETSERVE_FRAMES")  # no single capture beside them
    finally:
        await nc.close()


async def test_streams_resume_from_their_partitions_on_another_replica(fleet: Fleet) -> None:
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:25"}

    async def cut_and_resume(c: httpx.AsyncClient) -> str:
        async with c.stream(
            "POST", f"{fleet.base_urls[0]}/v1/chat/completions", json=BODY, headers=headers
        ) as r:
            request_id = r.headers["x-request-id"]
            first, last_id, _, _ = await read_events(r, stop_after=5)
        assert last_id > 0
        async with c.stream(
            "GET",
            f"{fleet.base_urls[1]}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {fleet.api_key}", "Last-Event-ID": str(last_id)},
        ) as r2:
            assert r2.status_code == 200
            rest, _, done, error = await read_events(r2)
        assert error is None
        assert done
        assert "".join(first) + "".join(rest) == reference(fleet)
        return request_id

    async with httpx.AsyncClient(timeout=30) as c:
        ids = await asyncio.gather(*(cut_and_resume(c) for _ in range(4)))
    partitions = sorted(frames_partition(rid, P) for rid in ids)
    print(f"\nresumed from partitions {partitions}")


async def test_another_tenant_cannot_resume_a_partitioned_stream(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        admin.create_tenant("intruder")
        other = admin.create_key("intruder")["api_key"]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={**BODY, "stream": False, "max_tokens": 5},
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
        request_id = r.headers["x-request-id"]
        denied = await c.get(
            f"{fleet.base_urls[1]}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {other}"},
        )
        mine = await c.get(
            f"{fleet.base_urls[1]}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {fleet.api_key}", "Last-Event-ID": "0"},
        )
    assert denied.status_code == 404
    assert denied.json()["error"]["code"] == "stream_not_found"
    assert mine.status_code == 200
    assert "data: [DONE]" in mine.text


async def test_the_agent_credential_recovers_tokens_from_the_partition(fleet: Fleet) -> None:
    """The model-call recovery path (InferenceClient.follow/recover, which an
    executor taking over a step reads its call's answer through), as the agent role."""
    body = {**BODY, "stream": False, "max_tokens": 12, "temperature": 0}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
    assert r.status_code == 200
    rid, answer = r.headers["x-request-id"], r.json()
    n = answer["usage"]["completion_tokens"]
    nc, topo = await _topology(fleet, Role.AGENT)
    try:
        client = InferenceClient(nc, nc.jetstream(), topo)
        tokens = await client.recover(fleet.spec.tenant, rid, 1, 0, n, wait_s=10.0)
        assert tokens is not None
        assert [t.seq for t in tokens] == list(range(1, n + 1))
        assert "".join(t.text for t in tokens) == answer["choices"][0]["message"]["content"]
        # The same reader given one partition reads nothing of it.
        single = InferenceClient(nc, nc.jetstream(), Topology())
        assert await single.recover(fleet.spec.tenant, rid, 1, 0, n, wait_s=0.5) is None
    finally:
        await nc.close()


async def test_an_agent_runs_model_calls_are_captured_in_their_partitions(fleet: Fleet) -> None:
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": "say hi"}], "tools": []}
    async with httpx.AsyncClient(base_url=fleet.base_url, headers=headers, timeout=30) as c:
        created = await c.post("/v1/runs", json=body)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]

        async def finished() -> dict[str, Any] | None:
            run: dict[str, Any] = (await c.get(f"/v1/runs/{run_id}")).json()
            return run if run["status"] in ("completed", "failed") else None

        await until(finished, f"run {run_id} to finish", 30.0)
        run = await finished()
    assert run is not None
    assert run["status"] == "completed", run
    rid = model_request_id(run_id, 0, 1)
    nc, topo = await _topology(fleet)
    try:
        held = await _held_by(nc.jetstream(), topo, fleet.spec.tenant, rid)
    finally:
        await nc.close()
    mine = topo.frames_stream_of(rid)
    assert held[mine] >= 2, (rid, held)
    assert sum(held.values()) == held[mine], held


@pytest.mark.timeout(120)
async def test_the_orphan_sweep_settles_from_the_partitions(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Gateway 0 is SIGKILLed with streams in flight; gateway 1's sweep settles
    each from its own partition stream once its hold expires (deadline + grace):
    an orphan read from the wrong stream would be released uncharged, no record."""
    args = ["--sweep-every", "1", "--settle-grace", "1", "--timeout", "4"]
    fleet = make_fleet(gateways=2, workers=1, frames_partitions=P, gateway_args=args)
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "stall"}
    body = {**BODY, "stream": True, "max_tokens": 16}
    ids: list[str] = []
    async with httpx.AsyncClient(timeout=60) as c:

        async def open_stream() -> None:
            try:
                async with c.stream(
                    "POST", f"{fleet.base_urls[0]}/v1/chat/completions", json=body, headers=headers
                ) as r:
                    ids.append(r.headers["x-request-id"])
                    async for _ in r.aiter_lines():
                        pass
            except httpx.TransportError:
                pass  # its gateway was killed mid-stream

        streams = [asyncio.create_task(open_stream()) for _ in range(8)]

        async def started() -> bool:
            return len(ids) == 8

        await until(started, "8 streams started", 60.0)
        fleet.gateways[0].kill()
        await asyncio.gather(*streams)

    def records() -> list[dict[str, Any]]:
        with fleet.admin() as admin:
            text = admin.ledger(fleet.spec.tenant)
        rows = [msgspec.json.decode(x) for x in text.splitlines() if x]
        return [r for r in rows if r["request_id"] in ids]

    async def all_settled() -> bool:
        return len(await asyncio.to_thread(records)) >= len(ids)

    await until(all_settled, "the sweep to settle every stream", 60.0)
    rows = records()
    assert sorted(r["request_id"] for r in rows) == sorted(ids)
    assert {r["policy"] for r in rows} == {"admitted:recovered"}
    assert {r["outcome"] for r in rows} == {"deadline_exceeded"}
    assert {r["usage"]["completion_tokens"] for r in rows} == {1}
    assert all(r["charge_micros"] > 0 for r in rows), rows
    print(f"\nswept from partitions {sorted(frames_partition(rid, P) for rid in ids)}")

"""Temperature-0 coalescing end to end (gateway ``--coalesce``): identical
requests share one engine generation, each still its own accepted request with
its own id and ledger record, charged once; never across tenants, never at T>0;
the leader leaving does not break the followers."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet, FleetSpec
from tests.refusals import checked_fleet
from tests.waits import until

pytestmark = pytest.mark.connected

N = 6


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    spec = FleetSpec(
        workers=2,
        profile="h100-8b",  # real latencies: identical requests overlap in flight
        gateway_args=["--coalesce", "--price", "sim-8b=1000/1000"],
    )
    with checked_fleet(request, spec) as f:
        yield f


def long_chat(max_tokens: int) -> dict[str, Any]:
    """A request that really generates ``max_tokens`` (the simulator's text
    otherwise ends after 16..64 tokens): one that must still run while others
    join and leave."""
    return chat(max_tokens=max_tokens, ignore_eos=True)


def chat(max_tokens: int = 30, **kw: Any) -> dict[str, Any]:
    return {
        "model": "sim-8b",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"explain coalescing {uuid.uuid4().hex}"}],
        **kw,
    }


async def stream(
    c: httpx.AsyncClient,
    fleet: Fleet,
    body: dict[str, Any],
    key: str | None = None,
    *,
    started: asyncio.Event | None = None,
    leave_after: int | None = None,
    at: int = 0,
) -> tuple[str, str]:
    """(request id, text) of one streaming request to gateway ``at``;
    ``leave_after`` chunks: disconnect."""
    headers = {"Authorization": f"Bearer {key or fleet.api_key}"}
    parts: list[str] = []
    async with c.stream(
        "POST",
        f"{fleet.base_urls[at]}/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        headers=headers,
    ) as r:
        assert r.status_code == 200, await r.aread()
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
            if parts and started is not None:
                started.set()
            if leave_after is not None and len(parts) >= leave_after:
                break  # closing the response: the client is gone
    return rid, "".join(parts)


async def sim_stats(c: httpx.AsyncClient, fleet: Fleet) -> dict[str, Any]:
    return dict((await c.get(f"{fleet.sim_url}/sim/stats")).json())


async def coalesced_total(c: httpx.AsyncClient, fleet: Fleet) -> float:
    text = (await c.get(fleet.gateway_metrics_urls[0])).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("jetserve_gateway_coalesced_total")
    )


def ledger(fleet: Fleet, tenant: str, ids: set[str]) -> dict[str, dict[str, Any]]:
    with fleet.admin() as admin:
        text = admin.ledger(tenant)
    records = [msgspec.json.decode(line) for line in text.splitlines() if line]
    return {r["request_id"]: r for r in records if r["request_id"] in ids}


async def test_identical_t0_requests_share_one_generation(fleet: Fleet) -> None:
    body = chat()
    async with httpx.AsyncClient(timeout=30) as c:
        before, coalesced_before = await sim_stats(c, fleet), await coalesced_total(c, fleet)
        results = await asyncio.gather(*(stream(c, fleet, body) for _ in range(N)))
        after = await sim_stats(c, fleet)
        assert after["requests"] - before["requests"] == 1  # one engine generation
        assert after["prompt_tokens"] - before["prompt_tokens"] > 0
        assert await coalesced_total(c, fleet) - coalesced_before == N - 1
    prefill = after["prompt_tokens"] - before["prompt_tokens"]
    print(
        f"\n{N} identical T=0 requests: 1 generation, "
        f"{prefill} prefill tokens ({N * prefill} without)"
    )
    ids = [rid for rid, _ in results]
    texts = {text for _, text in results}
    assert len(set(ids)) == N  # each its own accepted request
    assert len(texts) == 1  # every client got the full, same text
    assert texts.pop()
    records = ledger(fleet, fleet.spec.tenant, set(ids))
    assert set(records) == set(ids)  # one record each
    leaders = [r for r in records.values() if not r["coalesced_with"]]
    assert len(leaders) == 1
    leader = leaders[0]
    assert all(
        r["coalesced_with"] == leader["request_id"] for r in records.values() if r is not leader
    )
    # One GPU execution, one charge; every record still shows the usage it got.
    assert leader["charge_micros"] > 0
    assert sum(r["charge_micros"] for r in records.values()) == leader["charge_micros"]
    assert all(r["usage"] == leader["usage"] for r in records.values())


async def test_other_tenants_and_sampled_requests_are_not_coalesced(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        admin.create_tenant("coalesce-other")
        other_key = admin.create_key("coalesce-other")["api_key"]
    same = chat()
    sampled = chat(temperature=0.7)
    default_t = {k: v for k, v in chat().items() if k != "temperature"}  # engine default: 1.0
    async with httpx.AsyncClient(timeout=30) as c:
        before = await sim_stats(c, fleet)
        results = await asyncio.gather(
            stream(c, fleet, same),
            stream(c, fleet, same, other_key),
            *(stream(c, fleet, sampled) for _ in range(3)),
            *(stream(c, fleet, default_t) for _ in range(2)),
        )
        after = await sim_stats(c, fleet)
    assert after["requests"] - before["requests"] == 7
    assert results[0][1] == results[1][1]  # same answer, computed once per tenant


async def test_leader_leaving_mid_stream_does_not_break_followers(fleet: Fleet) -> None:
    # Long enough (seconds of decode on h100-8b) that the leader leaves while the
    # generation still runs, even when joining three followers is slow on a loaded box.
    body = long_chat(400)
    async with httpx.AsyncClient(timeout=30) as c:
        before = await sim_stats(c, fleet)
        leader_started = asyncio.Event()
        release = asyncio.Event()

        async def leader() -> tuple[str, str]:
            headers = {"Authorization": f"Bearer {fleet.api_key}"}
            async with c.stream(
                "POST",
                f"{fleet.base_url}/v1/chat/completions",
                json={**body, "stream": True},
                headers=headers,
            ) as r:
                rid = r.headers["x-request-id"]
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        leader_started.set()
                        await release.wait()
                        break  # leaves while the generation is still running
            return rid, ""

        lead = asyncio.create_task(leader())
        await leader_started.wait()
        joined = [asyncio.Event() for _ in range(3)]
        followers = [asyncio.create_task(stream(c, fleet, body, started=e)) for e in joined]
        for e in joined:
            await e.wait()  # each has joined (the tokens so far were replayed to it)
        release.set()
        leader_id, _ = await lead
        results = await asyncio.gather(*followers)
        after = await sim_stats(c, fleet)
        assert after["requests"] - before["requests"] == 1
        assert after["aborted"] == before["aborted"]  # the engine was not stopped
        with fleet.admin() as admin:
            admin.create_tenant("coalesce-ref")
            ref_key = admin.create_key("coalesce-ref")["api_key"]
        _, reference = await stream(c, fleet, body, ref_key)  # its own generation
    assert all(text == reference for _, text in results)
    ids = {leader_id, *(rid for rid, _ in results)}
    records = ledger(fleet, fleet.spec.tenant, ids)
    assert set(records) == ids
    assert records[leader_id]["outcome"] == "cancelled"
    assert records[leader_id]["charge_micros"] == 0  # the payer role moved on
    charged = [r for r in records.values() if r["charge_micros"] > 0]
    assert len(charged) == 1
    assert charged[0]["coalesced_with"] == leader_id


# -- across replicas (gateway/inference/coalesce_fleet.py) -------------------------


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    spec = FleetSpec(
        workers=2,
        gateways=2,
        profile="h100-8b",
        gateway_args=["--coalesce", "--price", "sim-8b=1000/1000"],
    )
    with checked_fleet(request, spec) as f:
        yield f


async def _fleet_coalesced(c: httpx.AsyncClient, fleet: Fleet) -> float:
    total = 0.0
    for url in fleet.gateway_metrics_urls:
        text = (await c.get(url)).text
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("jetserve_gateway_coalesced_total")
        )
    return total


async def _lead(
    c: httpx.AsyncClient,
    fleet: Fleet,
    body: dict[str, Any],
    started: asyncio.Event,
    release: asyncio.Event | None = None,
) -> tuple[str, str]:
    """The first request, on gateway 0: it reads to the end, or leaves after its
    first chunk once ``release`` is set."""
    if release is None:
        return await stream(c, fleet, body, started=started)
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    async with c.stream(
        "POST",
        f"{fleet.base_urls[0]}/v1/chat/completions",
        json={**body, "stream": True},
        headers=headers,
    ) as r:
        assert r.status_code == 200, await r.aread()
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                started.set()
                await release.wait()
                break  # leaves while the generation is still running
    return rid, ""


async def test_identical_requests_on_two_gateways_share_one_generation(pair: Fleet) -> None:
    body = long_chat(300)  # seconds of decode: the others arrive while it runs
    async with httpx.AsyncClient(timeout=30) as c:
        before, coalesced_before = await sim_stats(c, pair), await _fleet_coalesced(c, pair)
        started = asyncio.Event()
        lead = asyncio.create_task(_lead(c, pair, body, started))
        await started.wait()
        others = await asyncio.gather(*(stream(c, pair, body, at=i % 2) for i in range(1, N)))
        results = [await lead, *others]
        after = await sim_stats(c, pair)
        assert after["requests"] - before["requests"] == 1  # one engine generation
        assert await _fleet_coalesced(c, pair) - coalesced_before == N - 1
    texts = {text for _, text in results}
    assert len(texts) == 1  # every client got the whole, same text
    assert texts.pop()
    ids = {rid for rid, _ in results}
    records = ledger(pair, pair.spec.tenant, ids)
    assert set(records) == ids
    leader_id = results[0][0]
    assert all(records[rid]["coalesced_with"] == leader_id for rid in ids - {leader_id})
    charged = [r for r in records.values() if r["charge_micros"] > 0]
    assert [r["request_id"] for r in charged] == [leader_id]  # charged once, fleet-wide


async def test_leader_leaving_on_one_gateway_keeps_the_other_reading(pair: Fleet) -> None:
    body = long_chat(400)
    async with httpx.AsyncClient(timeout=30) as c:
        before = await sim_stats(c, pair)
        started, release = asyncio.Event(), asyncio.Event()
        lead = asyncio.create_task(_lead(c, pair, body, started, release))
        await started.wait()
        joined = [asyncio.Event() for _ in range(2)]
        followers = [asyncio.create_task(stream(c, pair, body, started=e, at=1)) for e in joined]
        for e in joined:
            await e.wait()  # reading the leader's capture on gateway 1
        release.set()
        leader_id, _ = await lead
        results = await asyncio.gather(*followers)
        after = await sim_stats(c, pair)
        assert after["requests"] - before["requests"] == 1
        assert after["aborted"] == before["aborted"]  # the engine was not stopped
        with pair.admin() as admin:
            admin.create_tenant("coalesce-pair-ref")
            ref_key = admin.create_key("coalesce-pair-ref")["api_key"]
        _, reference = await stream(c, pair, body, ref_key)
    assert all(text == reference for _, text in results)
    ids = {leader_id, *(rid for rid, _ in results)}
    records = ledger(pair, pair.spec.tenant, ids)
    assert records[leader_id]["outcome"] == "cancelled"
    assert records[leader_id]["charge_micros"] == 0  # its group left others reading
    charged = [r for r in records.values() if r["charge_micros"] > 0]
    assert len(charged) == 1
    assert charged[0]["coalesced_with"] == leader_id


async def test_the_last_reader_anywhere_stops_the_engine(pair: Fleet) -> None:
    body = long_chat(2000)  # far longer than the test: only a cancel ends it early
    async with httpx.AsyncClient(timeout=30) as c:
        before = await sim_stats(c, pair)
        started, release = asyncio.Event(), asyncio.Event()
        lead = asyncio.create_task(_lead(c, pair, body, started, release))
        await started.wait()
        joined = asyncio.Event()
        follower = asyncio.create_task(stream(c, pair, body, started=joined, leave_after=1, at=1))
        await joined.wait()
        await follower  # gateway 1's group left: the leader still reads, nothing stops
        assert (await sim_stats(c, pair))["aborted"] == before["aborted"]
        release.set()
        await lead  # the last reader anywhere left: now the engine stops

        async def stopped() -> bool:
            return bool((await sim_stats(c, pair))["aborted"] > before["aborted"])

        await until(stopped, "the engine to stop")
        assert (await sim_stats(c, pair))["requests"] - before["requests"] == 1

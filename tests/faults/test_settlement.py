"""Charges and ledger records through the outbox (issue 13, item 3): Redis frozen
(SIGSTOP) while 200 requests settle, then thawed; the same with a gateway
SIGKILLed while its settlements wait, and streams in flight on it. Afterwards
the ledger's sum equals the Redis spend, no hold is left, and every request has
exactly one record."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet
from streams.outbox import DEFAULT_OUTBOX
from tests.scrape import fleet_sum
from tests.waits import until

pytestmark = pytest.mark.faults

BODY = {
    "model": "sim-8b",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "settle this"}],
}
# Fast scans so a thawed store is caught up within a second or two.
BOOKS_ARGS = ["--outbox-scan", "0.5", "--outbox-grace", "1", "--sweep-every", "1"]


async def inflight(fleet: Fleet) -> float:
    return await fleet_sum(fleet.gateway_metrics_urls, "jetserve_gateway_inflight")


def spend(fleet: Fleet) -> tuple[int, int]:
    with fleet.admin() as admin:
        view = admin.get_limits("tenant", fleet.spec.tenant)
    return int(view["spent_micros"]), int(view["reserved_micros"])


def ledger(fleet: Fleet) -> list[dict[str, Any]]:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    return [msgspec.json.decode(x) for x in text.splitlines() if x]


async def outbox_size(fleet: Fleet) -> int:
    nc = await fleet.connect()
    try:
        info = await nc.jetstream().stream_info(DEFAULT_OUTBOX.stream)
        return int(info.state.messages)
    finally:
        await nc.close()


def freeze(fleet: Fleet) -> None:
    assert fleet.redis is not None
    os.kill(fleet.redis.proc.pid, signal.SIGSTOP)


def thaw(fleet: Fleet) -> None:
    assert fleet.redis is not None
    os.kill(fleet.redis.proc.pid, signal.SIGCONT)


async def post(c: httpx.AsyncClient, url: str, fleet: Fleet, slow: int = 150) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": f"slow:{slow}"}
    r = await c.post(url, json=BODY, headers=headers)
    return r.status_code, r.headers.get("x-request-id", "")


async def settled_books(fleet: Fleet, spent_before: int) -> list[dict[str, Any]]:
    """Wait for the outbox to drain and every hold to settle; the ledger then."""

    async def drained() -> bool:
        _, reserved = spend(fleet)
        return reserved == 0 and await outbox_size(fleet) == 0

    await until(drained, "the outbox to drain and every hold to settle", 90.0)
    rows = ledger(fleet)
    spent, _ = spend(fleet)
    assert spent - spent_before == sum(int(r["charge_micros"]) for r in rows)
    return rows


def one_record_each(
    rows: list[dict[str, Any]], ids: list[str], outcome: str = "length"
) -> dict[str, dict[str, Any]]:
    """Exactly one record per id, each charged, with ``outcome``; by id."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[str(r["request_id"])] = counts.get(str(r["request_id"]), 0) + 1
    assert [i for i in ids if counts.get(i) != 1] == []
    mine = {str(r["request_id"]): r for r in rows if r["request_id"] in ids}
    for r in mine.values():
        assert r["charge_micros"] > 0, r
        assert r["outcome"] == outcome, r
    return mine


async def deferred(fleet: Fleet) -> float:
    """Settlements the gateways could not apply at once (left in the outbox)."""
    return await fleet_sum(
        fleet.gateway_metrics_urls, "jetserve_gateway_settlements_total", path="deferred"
    )


async def tried(fleet: Fleet, n: int) -> bool:
    """The gateways have tried to apply ``n`` settlements (applied or deferred)."""
    counts = [
        await fleet_sum(fleet.gateway_metrics_urls, "jetserve_gateway_settlements_total", path=p)
        for p in ("inline", "deferred")
    ]
    return sum(counts) >= n


async def admitted(fleet: Fleet, tasks: list[asyncio.Task[Any]], total: int) -> None:
    """Wait until every request is in flight or answered."""

    async def check() -> bool:
        return await inflight(fleet) + sum(t.done() for t in tasks) >= total

    await until(check, f"{total} requests admitted", 90.0)


async def test_redis_frozen_during_200_settlements(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2, gateways=1, gateway_args=BOOKS_ARGS)
    spent_before, _ = spend(fleet)
    url = f"{fleet.base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=300)) as c:
        tasks = [asyncio.create_task(post(c, url, fleet)) for _ in range(200)]
        await admitted(fleet, tasks, 200)
        freeze(fleet)  # they settle while Redis cannot answer
        try:
            results = await asyncio.gather(*tasks)
            # Answered once stored in the outbox; the applies run after, and
            # fail (Redis frozen) one timeout later: wait for all 200 to be tried.
            await until(lambda: tried(fleet, 200), "200 settlements tried", 90.0)
            during = await deferred(fleet)
        finally:
            thaw(fleet)
    assert [s for s, _ in results if s != 200] == []  # the client never waits on the books
    print(f"\n{during:.0f} of 200 settlements waited in the outbox while Redis was frozen")
    assert during >= 100  # most settled during the freeze (some may finish before it)
    rows = await settled_books(fleet, spent_before)
    one_record_each(rows, [rid for _, rid in results])


@pytest.mark.timeout(180)
async def test_gateway_killed_while_its_settlements_wait(make_fleet: Callable[..., Fleet]) -> None:
    """Redis frozen; gateway 0 answers its clients (settlements in its outbox,
    unapplied) and is SIGKILLed with streams still in flight. Gateway 1 applies
    the outbox; the orphan sweep settles the killed streams from the frames
    capture once their holds expire (deadline + grace)."""
    args = [*BOOKS_ARGS, "--timeout", "15", "--settle-grace", "1"]
    fleet = make_fleet(workers=2, gateways=2, gateway_args=args)
    spent_before, _ = spend(fleet)
    url0, url1 = (f"{u}/v1/chat/completions" for u in fleet.base_urls[:2])
    stream_ids: list[str] = []
    cut: list[str] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=300)) as c:

        async def open_stream() -> None:
            # A first token, then nothing until the deadline: still in flight at the kill.
            headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "stall"}
            body = {**BODY, "stream": True}
            rid = ""
            try:
                async with c.stream("POST", url0, json=body, headers=headers) as r:
                    rid = r.headers["x-request-id"]
                    stream_ids.append(rid)
                    async for _ in r.aiter_lines():
                        pass
            except httpx.TransportError:
                cut.append(rid)  # its gateway was killed mid-stream

        streams = [asyncio.create_task(open_stream()) for _ in range(10)]

        async def streams_started() -> bool:
            return len(stream_ids) == 10

        await until(streams_started, "10 streams started", 90.0)
        urls = (url0, url1)
        tasks = [asyncio.create_task(post(c, urls[n % 2], fleet, 20)) for n in range(200)]
        await admitted(fleet, tasks, 210)
        freeze(fleet)
        try:
            results = await asyncio.gather(*tasks)
            fleet.gateways[0].kill()  # its settlements wait in the outbox, unapplied
            await asyncio.gather(*streams)
        finally:
            thaw(fleet)
    assert [s for s, _ in results if s != 200] == []
    assert sorted(cut) == sorted(stream_ids)  # every stream was in flight on the killed gateway
    rows = await settled_books(fleet, spent_before)
    one_record_each(rows, [rid for _, rid in results])
    # Settled from the frames capture: one token and the worker's deadline error.
    recovered = one_record_each(rows, stream_ids, outcome="deadline_exceeded")
    assert {r["policy"] for r in recovered.values()} == {"admitted:recovered"}
    assert {r["usage"]["completion_tokens"] for r in recovered.values()} == {1}

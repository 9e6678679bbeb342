"""The hedge budget is the fleet's: replicas share one bank per class in a real
Redis, so N gateways cannot spend N banks (gateway/inference/hedge_budget.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.inference.dispatch import hedge_bank
from gateway.inference.hedge_budget import BANK_CAP, SharedHedgeBudget, bank_key
from gateway.inference.hedging import Hedger
from jetserve.fleet import Fleet
from jetserve.services import Service
from streams.routes import HedgePolicy
from streams.wire import InferenceRequest

pytestmark = pytest.mark.connected


async def test_a_routes_hedges_are_capped_by_its_own_ratio(redis_server: Service) -> None:
    """One bank per class: a route with max_extra_ratio 0.05 spent what a route with
    0.5 earned in the same class, up to every one of its requests hedged."""
    client = aioredis.from_url(redis_server.redis_url("gateway"))
    hedger = Hedger(SharedHedgeBudget(client, flush_s=60))
    generous = HedgePolicy(enabled=True, max_extra_ratio=0.5)
    strict = HedgePolicy(enabled=True, max_extra_ratio=0.05)

    def routed(route: str) -> InferenceRequest:
        return InferenceRequest(
            id="r", op="chat", cls="interactive", model=route, body={}, reply="x",
            deadline=0.0, route=route,
        )  # fmt: skip

    try:
        for _ in range(20):
            hedger.admit(hedge_bank(routed("r-generous")), generous)
        for _ in range(10):
            hedger.admit(hedge_bank(routed("r-strict")), strict)
        strict_taken = [await hedger.take(hedge_bank(routed("r-strict"))) for _ in range(10)]
        assert sum(strict_taken) == 0  # 10 x 0.05 earns half a hedge: none
        generous_taken = [await hedger.take(hedge_bank(routed("r-generous"))) for _ in range(20)]
        assert sum(generous_taken) == 10  # its own 20 x 0.5
    finally:
        await client.aclose()


async def test_three_replicas_share_one_bank_and_one_cap(redis_server: Service) -> None:
    clients = [aioredis.from_url(redis_server.redis_url("gateway")) for _ in range(3)]
    budgets = [SharedHedgeBudget(c, flush_s=60) for c in clients]  # flushed by take()
    try:
        # A quiet spell: 300 requests earn 30 hedges, but the bank holds BANK_CAP.
        for i in range(300):
            budgets[i % 3].earn("interactive", 0.1)
        for b in budgets:
            await b.flush()
        # A burst where every request wants a hedge: the three together get the
        # bank once, not once each.
        took = 0
        for i in range(90):
            took += await budgets[i % 3].take("interactive")
        assert took == BANK_CAP
        # From now on, credit as it is earned: 30 requests earn 3 hedges, fleet-wide.
        for i in range(30):
            b = budgets[i % 3]
            b.earn("interactive", 0.1)
            took += await b.take("interactive")
        assert took <= BANK_CAP + 3
        assert took >= BANK_CAP + 2  # float credit: the third may still be 0.99...
        # Classes have their own banks; the key is the class's, not a client's.
        assert not await budgets[0].take("batch")
        assert await clients[0].exists(bank_key("interactive"))
    finally:
        for c in clients:
            await c.aclose()


async def test_no_redis_means_no_hedge_and_credit_is_kept(redis_server: Service) -> None:
    client = aioredis.from_url(redis_server.redis_url("gateway"), socket_timeout=1.0)
    budget = SharedHedgeBudget(client, flush_s=60)
    try:
        budget.earn("interactive", 1.0)
        redis_server.stop()
        assert not await budget.take("interactive")  # fails closed: no extra attempt
        assert budget._earned == {"interactive": 1.0}  # not lost: added once Redis is back
    finally:
        await client.aclose()


def _hedges_sent(fleet: Fleet) -> float:
    total = 0.0
    for url in fleet.gateway_metrics_urls:
        for line in httpx.get(url, timeout=5).text.splitlines():
            if line.startswith("jetserve_gateway_hedges_total{") and 'outcome="sent"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(240)
async def test_hedges_stay_under_the_cap_across_three_gateways(
    make_fleet: Callable[..., Fleet],
) -> None:
    # No shedding: 30 stalled requests at once make a queue whose measured start
    # rate may say "unmeetable" on a loaded box; this test is about hedges.
    fleet = make_fleet(
        workers=2,
        gateways=3,
        gateway_args=["--hedge", "0.2", "--hedge-max-extra", "0.1", "--no-shed"],
    )
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    urls = fleet.base_urls
    async with httpx.AsyncClient(timeout=60) as c:
        sem = asyncio.Semaphore(16)

        async def ask(i: int, headers: dict[str, str]) -> None:
            body = {
                "model": "sim-8b",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": f"q{i}"}],
            }
            async with sem:
                r = await c.post(f"{urls[i % 3]}/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text

        # 300 quick requests earn 30 hedges; a replica's own bank would hold 10 of
        # them each (30 in all), the fleet's holds 10.
        await asyncio.gather(*(ask(i, auth) for i in range(300)))
        # None is late by design, but a loaded box can make one so (it spends from
        # the bank, which refills to at most its cap): count the burst's alone.
        before = _hedges_sent(fleet)
        # 30 requests whose first token is 1.5 s late, all at once: each wants a hedge.
        slow = {**auth, "X-Sim-Fault": "stall:1500"}
        await asyncio.gather(*(ask(i, slow) for i in range(30)))
    sent = _hedges_sent(fleet) - before
    # The bank (10) plus what the burst itself earned (30 x 0.1), fleet-wide.
    assert 1 <= sent <= BANK_CAP + 3, sent

"""Class order on one worker: interactive before batch, batch still progresses, and
each class starts its queued requests in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = pytest.mark.connected


async def test_interactive_overtakes_queued_batch_without_starving_it(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Batch gets one of the worker's two slots (the other is kept for
    interactive): with a stalled batch job holding it, the batch backlog waits
    in its queue, an interactive request sent behind it runs to its end before
    any of it reaches the engine, and the backlog still completes once the
    slot frees. No shedding: the stalled slot's start rate is nil, and shedding
    would rightly refuse what queues behind it (test_hedging_shedding.py)."""
    fleet = make_fleet(workers=1, worker_args=["--max-inflight", "2"], gateway_args=["--no-shed"])
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    url = f"{fleet.base_url}/v1/chat/completions"

    async def call(c: httpx.AsyncClient, cls: str, i: int) -> str:
        body = {
            "model": "sim-8b",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": f"{cls} job {i}"}],
        }
        r = await c.post(url, json=body, headers={**auth, "X-Jetserve-Class": cls})
        assert r.status_code == 200, r.text
        return str(r.headers["X-Request-Id"])

    async def hold(c: httpx.AsyncClient) -> None:
        # Stalls after its first token, holding batch's slot until it is cancelled.
        body = {"model": "sim-8b", "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": "batch holder"}]}  # fmt: skip
        headers = {**auth, "X-Jetserve-Class": "batch", "X-Sim-Fault": "stall"}
        async with c.stream("POST", url, json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_lines():
                pass

    async def batch_queued(c: httpx.AsyncClient) -> float:
        # In the class's queue, or held at the gateway for the tenant's turn.
        text = (await c.get(fleet.gateway_metrics_urls[0])).text
        return sum(
            metric_sum(text, name, cls="batch")
            for name in ("jetserve_queue_depth", "jetserve_gateway_fair_waiting")
        )

    async def started(c: httpx.AsyncClient) -> int:
        return int((await c.get(f"{fleet.sim_url}/sim/stats")).json()["started"])

    async with httpx.AsyncClient(timeout=120) as c:
        holder = asyncio.create_task(hold(c))
        await until(lambda: _started(c, fleet, 1), "the batch holder on the engine")
        batch = [asyncio.create_task(call(c, "batch", i)) for i in range(5)]
        await until(partial(_at_least, batch_queued, c, 5, batch), "the batch backlog queued")
        interactive = await call(c, "interactive", 0)
        # Interactive did not wait for the batch backlog: only it and the
        # holder have reached the engine.
        assert await started(c) == 2
        assert not any(t.done() for t in batch)
        holder.cancel()  # the client hangs up: batch's slot is freed
        batch_ids = await asyncio.gather(*batch)  # ... and the backlog is not starved
        recs = {
            rid: (await c.get(f"{fleet.sim_url}/sim/requests/{rid}")).json()
            for rid in [interactive, *batch_ids]
        }
    assert all(recs[rid]["status"] == "finished" for rid in recs), recs
    first = recs[interactive]["arrived_at"]
    assert all(recs[rid]["arrived_at"] > first for rid in batch_ids), recs


@pytest.mark.parametrize("cls", ["batch", "interactive"])
async def test_a_class_queue_starts_its_requests_in_arrival_order(
    make_fleet: Callable[..., Fleet], cls: str
) -> None:
    # Tail at saturation (issue 14) keeps FIFO within a class: with the one
    # engine slot taken, requests wait (in the class's queue, or at the gateway's
    # fair gate, FIFO per tenant) and the engine sees them in the order the gateway
    # accepted them. Laned, the order holds within a lane: one system prompt, one
    # lane (requests of other prefixes, in other lanes, may pass each other).
    # Each is sent only once the one before it is counted as waiting (the holder
    # is acked at its first token, so only the waiting ones count).
    # No shedding: with the one slot stalled the start rate is nil, and shedding
    # would rightly refuse what queues behind it (test_hedging_shedding.py). The
    # worker ranks this class first: a lower class waits out its starvation bound
    # for each slot (the class split, tested above), which only slows this.
    ranked = [cls, *({"batch", "interactive"} - {cls})]
    fleet = make_fleet(
        workers=1,
        worker_args=["--max-inflight", "1", "--classes", ",".join(ranked)],
        gateway_args=["--no-shed"],
    )
    auth = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Class": cls}
    url = f"{fleet.base_url}/v1/chat/completions"
    prefix = "the same long shared prompt prefix for every request of this test " * 4

    async def call(c: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": "sim-8b",
            "max_tokens": 8,
            "messages": [
                {"role": "system", "content": prefix},
                {"role": "user", "content": f"job {i}"},
            ],
        }
        r = await c.post(url, json=body, headers=auth)
        assert r.status_code == 200, r.text
        return r.headers["X-Request-Id"]

    async def queued(c: httpx.AsyncClient) -> float:
        # In the class's queue, or held at the gateway for the tenant's turn (the
        # fair gate keeps JetStream's queue short; its per-tenant queue is FIFO).
        text = (await c.get(fleet.gateway_metrics_urls[0])).text
        return sum(
            metric_sum(text, name, cls=cls)
            for name in ("jetserve_queue_depth", "jetserve_gateway_fair_waiting")
        )

    async def hold(c: httpx.AsyncClient) -> None:
        # Stalls after its first token, holding the one slot until it is cancelled.
        body = {"model": "sim-8b", "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": "holder"}]}  # fmt: skip
        async with c.stream("POST", url, json=body, headers={**auth, "X-Sim-Fault": "stall"}) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_lines():
                pass

    async with httpx.AsyncClient(timeout=120) as c:
        holder = asyncio.create_task(hold(c))
        await until(lambda: _started(c, fleet, 1), "the holder on the engine")
        tasks: list[asyncio.Task[str]] = []
        for i in range(6):
            tasks.append(asyncio.create_task(call(c, i)))
            await until(partial(_at_least, queued, c, i + 1, tasks), f"request {i} queued")
        holder.cancel()  # the client hangs up: the slot is freed
        ids = await asyncio.gather(*tasks)
        arrived = [(await c.get(f"{fleet.sim_url}/sim/requests/{rid}")).json() for rid in ids]
    order = sorted(range(len(ids)), key=lambda k: arrived[k]["arrived_at"])
    assert order == list(range(len(ids)))


async def _started(c: httpx.AsyncClient, fleet: Fleet, n: int) -> bool:
    return int((await c.get(f"{fleet.sim_url}/sim/stats")).json()["started"]) >= n


async def _at_least(
    value: Callable[[httpx.AsyncClient], Awaitable[float]],
    c: httpx.AsyncClient,
    n: int,
    tasks: list[asyncio.Task[str]],
) -> bool:
    for t in tasks:
        if t.done():
            t.result()  # a request that failed fails the test now, not at the bound
    return await value(c) >= n

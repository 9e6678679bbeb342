"""The fair gate's rules (gateway/inference/fair_gate.py) on the queue watch's
numbers: tenants in turn, refusal by a tenant's own queue, deadlines, bounds.
(Through real NATS and a fleet: tests/connected/test_fairness.py.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from gateway.errors import RateLimited
from gateway.inference.fair_gate import MIN_BACKLOG, DeadlinePassed, FairGate
from gateway.inference.shedding import QueueWatch
from streams.definitions import DEFAULT_TOPOLOGY

CLS = "interactive"


def gate_and_load() -> tuple[FairGate, Any]:
    watch = QueueWatch(cast(Any, None), DEFAULT_TOPOLOGY)  # never started: numbers set here
    return FairGate(watch), watch.loads[CLS]


async def test_a_class_without_a_queue_lets_requests_straight_through() -> None:
    gate, load = gate_and_load()
    for _ in range(50):  # no rate known yet: never held
        await asyncio.wait_for(gate.enter(CLS, "a", time.time() + 10), 1)
    load.rate, load.depth, load.at = 100.0, MIN_BACKLOG - 1, time.monotonic()
    for _ in range(50):  # a queue under the target: the workers keep up
        await asyncio.wait_for(gate.enter(CLS, "a", time.time() + 10), 1)
    assert load.since == 100  # counted as published
    assert gate.of(CLS).waiting == 0


async def test_tenants_go_in_turn_once_the_class_has_a_queue() -> None:
    gate, load = gate_and_load()
    load.depth, load.rate, load.at = 100, 10.0, time.monotonic()  # a queue: nobody passes
    order: list[str] = []

    async def one(tenant: str) -> None:
        await gate.enter(CLS, tenant, time.time() + 30)
        order.append(tenant)

    tasks = [asyncio.create_task(one("a")) for _ in range(5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("b")))
    await asyncio.sleep(0)
    assert gate.of(CLS).waiting == 6
    # The queue drained, and the fleet starts them fast: they go, in turn.
    load.depth, load.rate, load.at = 0, 1000.0, time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["a", "b", "a", "a", "a", "a"]  # b's first before a's second


async def test_a_request_is_refused_by_its_own_tenants_queue() -> None:
    gate, load = gate_and_load()
    load.depth, load.rate, load.at = 10, 4.0, time.monotonic()
    floods = [asyncio.create_task(gate.enter(CLS, "a", time.time() + 60)) for _ in range(40)]
    await asyncio.sleep(0)
    # a's 41st would start after ~(10 + 41 x 1) / 4 s: past a 5 s deadline, refused now.
    with pytest.raises(RateLimited) as info:
        await gate.enter(CLS, "a", time.time() + 5)
    assert info.value.code == "deadline_unmeetable"
    # b's first is judged by b's queue (empty): it waits its turn instead.
    b = asyncio.create_task(gate.enter(CLS, "b", time.time() + 5))
    await asyncio.sleep(0)
    assert not b.done()
    for t in [*floods, b]:
        t.cancel()
    await asyncio.gather(*floods, b, return_exceptions=True)
    assert gate.of(CLS).waiting == 0  # cancelled waiters leave the queue


async def test_a_wait_past_the_deadline_ends_504() -> None:
    gate, load = gate_and_load()
    load.depth, load.rate, load.at = 500, 1000.0, time.monotonic()  # due in ~0.5 s
    waiting = asyncio.create_task(gate.enter(CLS, "a", time.time() + 2.0))
    await asyncio.sleep(0)
    # The next look: the queue has not moved, the fleet has all but stopped.
    load.rate, load.at = 0.001, time.monotonic()
    with pytest.raises(DeadlinePassed) as info:
        await waiting
    assert (info.value.status, info.value.code) == (504, "deadline_exceeded")
    assert gate.of(CLS).waiting == 0
    await gate.stop()

"""The fair gate's rules (gateway/inference/fair_gate.py) on the queue watch's
numbers: tenants in turn, refusal by a tenant's own queue, deadlines, bounds.
(Through real NATS and a fleet: tests/connected/test_fairness.py.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from gateway.errors import ClientLeft, RateLimited
from gateway.inference.fair_gate import IN_TURN_BURST, MIN_BACKLOG, DeadlinePassed, FairGate
from gateway.inference.shedding import QueueWatch
from streams.definitions import DEFAULT_TOPOLOGY

CLS = "interactive"


def gate_and_load(burst: float = 1.0) -> tuple[FairGate, Any]:
    """A gate on numbers set here (its watch never started); ``burst`` 1 by default:
    a tenant passes at once only with no turn owed, so the orders below are exact."""
    watch = QueueWatch(cast(Any, None), DEFAULT_TOPOLOGY)
    return FairGate(watch, burst=burst), watch.loads[CLS]


async def waits_its_turn(gate: FairGate, tenant: str, deadline_in: float) -> None:
    """One more request of ``tenant`` waits (neither passes nor is refused); then
    it leaves, and the gate stops."""
    waiting = asyncio.create_task(gate.enter(CLS, tenant, time.time() + deadline_in))
    await asyncio.sleep(0)
    assert gate.of(CLS).waiting == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await gate.stop()


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
    order: list[tuple[str, bool]] = []

    async def one(tenant: str) -> None:
        excess = await gate.enter(CLS, tenant, time.time() + 30)
        order.append((tenant, excess))

    tasks = [asyncio.create_task(one("a")) for _ in range(5)]
    await asyncio.sleep(0)
    # a's first was in turn (nothing of a's owed): it went at once; the rest wait.
    assert order == [("a", False)]
    assert gate.of(CLS).waiting == 4
    tasks.append(asyncio.create_task(one("b")))
    await asyncio.sleep(0)
    assert order[-1] == ("b", False)  # b's first is in turn too: at once, not queued
    tasks += [asyncio.create_task(one("b")) for _ in range(2)]
    await asyncio.sleep(0)
    assert gate.of(CLS).waiting == 6
    # The queue drained, and the fleet starts them fast: they go, in turn, and
    # (another tenant around) to the class's excess subject while more of their
    # tenant's wait behind them; a tenant's last one goes in turn.
    load.depth, load.rate, load.at = 0, 1000.0, time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    apart = [i not in (3, 5) for i in range(6)]  # a tenant's last waiting goes in turn
    assert order[2:] == list(zip("ababaa", apart, strict=True))
    assert (gate.of(CLS).in_turn, gate.of(CLS).excess) == (2, 4)


async def test_a_tenant_alone_in_its_class_keeps_the_class_subject() -> None:
    gate, load = gate_and_load()
    load.depth, load.rate, load.at = 100, 10.0, time.monotonic()
    tasks = [asyncio.create_task(gate.enter(CLS, "a", time.time() + 30)) for _ in range(4)]
    await asyncio.sleep(0)
    load.depth, load.rate, load.at = 0, 1000.0, time.monotonic()
    # Nobody else around: no slot is kept from it for anyone.
    assert await asyncio.wait_for(asyncio.gather(*tasks), 5) == [False] * 4
    await gate.stop()


async def test_a_request_is_refused_by_its_own_tenants_queue() -> None:
    gate, load = gate_and_load()
    load.depth, load.rate, load.at = 10, 4.0, time.monotonic()
    floods = [asyncio.create_task(gate.enter(CLS, "a", time.time() + 60)) for _ in range(40)]
    await asyncio.sleep(0)
    # a's 41st would start after ~(10 + 41 x 1) / 4 s: past a 5 s deadline, refused now.
    with pytest.raises(RateLimited) as info:
        await gate.enter(CLS, "a", time.time() + 5)
    assert info.value.code == "deadline_unmeetable"
    # b's first is judged by b's queue (empty): in turn, it goes at once; b's
    # second waits its turn (a's flood ahead does not refuse it).
    assert await asyncio.wait_for(gate.enter(CLS, "b", time.time() + 5), 1) is False
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
    await gate.enter(CLS, "a", time.time() + 2.0)  # in turn: at once; a owes one now
    waiting = asyncio.create_task(gate.enter(CLS, "a", time.time() + 2.0))
    await asyncio.sleep(0)
    # The next look: the queue has not moved, the fleet has all but stopped.
    load.rate, load.at = 0.001, time.monotonic()
    with pytest.raises(DeadlinePassed) as info:
        await waiting
    assert (info.value.status, info.value.code) == (504, "deadline_exceeded")
    assert gate.of(CLS).waiting == 0
    await gate.stop()


async def test_a_tenant_of_weight_two_gets_two_turns_for_one() -> None:
    gate, load = gate_and_load(burst=0.0)  # nobody passes at once: every request waits
    load.depth, load.rate, load.at = 100, 10.0, time.monotonic()
    order: list[str] = []

    async def one(tenant: str, weight: float) -> None:
        await gate.enter(CLS, tenant, time.time() + 30, weight)
        order.append(tenant)

    tasks = [asyncio.create_task(one(t, w)) for t, w in [("a", 1.0), ("b", 2.0)] * 6]
    await asyncio.sleep(0)
    assert gate.of(CLS).waiting == 12
    load.depth, load.rate, load.at = 0, 1000.0, time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    # b's tags advance by 1/2 a turn, a's by 1: b goes twice as often.
    assert "".join(order[:9]) == "babbabbab"
    await gate.stop()


async def test_a_light_tenant_passes_a_short_burst_at_once() -> None:
    gate, load = gate_and_load(burst=IN_TURN_BURST)
    load.depth, load.rate, load.at = 100, 10.0, time.monotonic()
    # Nothing released meanwhile (a saturated class): up to the burst at once...
    for _ in range(int(IN_TURN_BURST)):
        assert await asyncio.wait_for(gate.enter(CLS, "b", time.time() + 30), 1) is False
    # ...then it waits its turn like anyone.
    await waits_its_turn(gate, "b", 30)


async def test_a_refused_request_leaves_no_queue_of_its_tenant_behind() -> None:
    gate, load = gate_and_load()
    load.depth, load.rate, load.at = 10, 4.0, time.monotonic()
    for n in range(20):
        assert await gate.enter(CLS, f"t{n}", time.time() + 30) is False  # in turn
        with pytest.raises(RateLimited):  # its next, behind the backlog: past 1 s
            await gate.enter(CLS, f"t{n}", time.time() + 1)
    load.depth, load.since, load.at = 10, 0, time.monotonic()  # a new look
    assert await gate.enter(CLS, "a", time.time() + 30) is False
    # a's next starts after ~(11 + 1) / 4 s: inside an 8 s deadline, so it waits its
    # turn. The twenty refused tenants, waiting for nothing, used to be counted as
    # twenty queues ahead ((11 + 21) / 4 s): it was refused too.
    await waits_its_turn(gate, "a", 8)


async def test_a_request_whose_client_left_leaves_the_queue_unpublished() -> None:
    """It used to wait on for its turn, then be published, then cancelled at once
    by id: a publish and a removal for nothing, at the moment the class is busiest."""
    left: list[tuple[str, str]] = []
    watch = QueueWatch(cast(Any, None), DEFAULT_TOPOLOGY)
    gate = FairGate(watch, passed=lambda cls, way: left.append((cls, way)), burst=1.0)
    load = watch.loads[CLS]
    load.depth, load.rate, load.at = 100, 10.0, time.monotonic()  # a queue: a's next waits
    assert await gate.enter(CLS, "a", time.time() + 30) is False  # in turn
    gone = asyncio.Event()
    waiting = asyncio.create_task(gate.enter(CLS, "a", time.time() + 30, gone=gone))
    await asyncio.sleep(0)
    assert gate.of(CLS).waiting == 1
    published = load.since
    gone.set()
    with pytest.raises(ClientLeft):
        await asyncio.wait_for(waiting, 5)
    assert gate.of(CLS).waiting == 0
    assert (CLS, "left") in left
    assert load.since == published  # not counted in the class's backlog
    await gate.stop()


async def test_the_answer_time_counts_toward_the_deadline_as_the_shedder_counts_it() -> None:
    gate, load = gate_and_load()
    load.depth, load.rate, load.at = 10, 4.0, time.monotonic()
    floods = [asyncio.create_task(gate.enter(CLS, "a", time.time() + 60)) for _ in range(4)]
    await asyncio.sleep(0)
    # a's 5th starts after ~(10 + 5) / 4 = 3.75 s: inside a 6 s deadline's margin...
    fits = asyncio.create_task(gate.enter(CLS, "a", time.time() + 6))
    await asyncio.sleep(0)
    assert not fits.done()
    # ...but not once its answer (2 s after it starts) is counted: refused now, not 504 later.
    with pytest.raises(RateLimited) as info:
        await gate.enter(CLS, "a", time.time() + 6, service_s=2.0)
    assert info.value.code == "deadline_unmeetable"
    for t in [*floods, fits]:
        t.cancel()
    await asyncio.gather(*floods, fits, return_exceptions=True)
    await gate.stop()


def test_a_queue_nobody_has_started_teaches_no_rate() -> None:
    # A deployment pool's first requests, queued before its workers attach: no
    # start is no evidence of capacity, and a rate learnt as 0 shed the next burst.
    watch = QueueWatch(cast(Any, None), DEFAULT_TOPOLOGY)
    watch._take("interactive", 5, 0, 0)
    watch.loads["interactive"].at -= 1.0  # a look a second later: still nothing started
    watch._take("interactive", 6, 0, 0)
    assert watch.loads["interactive"].rate is None
    assert watch.verdict("interactive", 10.0, 0.05) is None  # nobody refused blind
    # Once something starts, the rate is learnt (and may fall to 0 later: a
    # fleet that stops starting work does shed).
    watch.loads["interactive"].at -= 1.0
    watch._take("interactive", 4, 0, 3)
    assert (watch.loads["interactive"].rate or 0) > 2.0  # 3 started in about a second


def _look(watch: QueueWatch, cls: str, depth: int, started: int, after_s: float = 1.0) -> None:
    """A look ``after_s`` after the last one: ``depth`` queued, ``started`` more begun."""
    load = watch.loads[cls]
    load.at -= after_s
    watch._take(cls, depth, 0, load.delivered + started)


def _watching(cls: str, depth: int, starts: int, looks: int) -> QueueWatch:
    """A watch that has had ``looks`` looks a second apart: ``depth`` queued at
    each, ``starts`` begun between them."""
    watch = QueueWatch(cast(Any, None), DEFAULT_TOPOLOGY)
    watch._take(cls, depth, 0, 0)
    for _ in range(looks):
        _look(watch, cls, depth, starts)
    return watch


def test_a_stall_sheds_while_it_lasts_and_is_forgotten_once_starts_resume() -> None:
    # A failover: a standing queue and nothing started for 8 s. While it lasts
    # the rate falls and a tight deadline is refused; once starts resume the
    # rate goes on from before the stall, so nothing is refused for the
    # seconds the smoothing would take to climb back.
    cls = "interactive"
    watch = _watching(cls, 8, 4, 6)  # 4 starts a second
    before = watch.loads[cls].rate or 0
    assert 3.0 < before <= 4.0
    assert watch.verdict(cls, 10.0, 0.05) is None  # 8 queued: 2 s
    for _ in range(8):
        _look(watch, cls, 8, 0)
    assert (watch.loads[cls].rate or 0) < before / 10
    assert watch.verdict(cls, 10.0, 0.05) is not None  # nothing moves: shed
    _look(watch, cls, 8, 4)
    assert (watch.loads[cls].rate or 0) == pytest.approx(before, rel=0.05)
    assert watch.verdict(cls, 10.0, 0.05) is None


def test_a_slow_class_gap_between_starts_is_not_a_stall() -> None:
    # One start every 2 s: a second without a start is the class's pace, and
    # the smoothed rate keeps what it learnt from it (no reset to the peak).
    watch = QueueWatch(cast(Any, None), DEFAULT_TOPOLOGY)
    cls = "batch"
    watch._take(cls, 5, 0, 0)
    for _ in range(10):
        _look(watch, cls, 5, 0)
        _look(watch, cls, 5, 1)
    rate = watch.loads[cls].rate or 0
    assert 0.3 < rate < 0.8  # about 0.5 a second, not the 1.0 of a start's second
    _look(watch, cls, 5, 0)
    lowered = watch.loads[cls].rate or 0
    _look(watch, cls, 5, 1)
    assert (watch.loads[cls].rate or 0) < rate + 0.3  # blended, not restored and raised
    assert lowered < rate


def test_a_standing_queue_is_counted_once_not_twice() -> None:
    # 12 queued, 4 starts a second: 3 s of wait. The client-side first-token
    # delay of the last answers (3.1 s) is that wait plus the engine's 0.1 s;
    # added to the wait, a 5 s deadline looked unmeetable (6.1 s > 4 s). Once
    # workers report their own first-token delay (from their start), the wait
    # counts once: 3.1 s fits in 0.8 x 5 s.
    cls = "interactive"
    watch = _watching(cls, 12, 4, 6)
    assert watch.verdict(cls, 5.0, 3.1) is not None  # no worker figure yet: the fallback
    watch.started_to_first_token(cls, 0.1)
    assert watch.first_token_time(cls, 3.1) == pytest.approx(0.1)
    assert watch.verdict(cls, 5.0, 3.1) is None
    assert watch.verdict(cls, 3.0, 3.1) is not None  # a deadline the wait itself outlasts

"""The step model, measured in model time: the simulator's engine on a virtual clock.

Each test drives a Simulator's engine the way the HTTP handlers do (add, next_tokens
per round, finish/abort) and reads TTFT and ITL from the engine's own clock, so the
claims hold on a loaded machine: nothing here is a wall-clock bound.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from collections.abc import Callable

import pytest

from sim.clock import VirtualClock
from sim.config import SimConfig
from sim.faults import parse_fault
from sim.sequence import Sequence
from sim.simulator import Simulator


class Stream:
    """One request's client: its token times on the engine clock."""

    def __init__(self, sim: Simulator, prompt_len: int, max_tokens: int, *, width: int = 1,
                 fault: str | None = None, seed: int = 0) -> None:  # fmt: skip
        self.sim = sim
        rng = random.Random(seed)
        self.prompt = [rng.randrange(1000, 100_000) for _ in range(prompt_len)]
        self.max_tokens = max_tokens
        self.width = width
        self.fault = parse_fault(fault) if fault else None
        self.times: list[float] = []
        self.seq: Sequence | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Stream:
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        sim = self.sim
        rec = sim.new_record(f"r{id(self)}", "completions", self.fault)
        seq = self.seq = sim.engine.add(rec, self.prompt, self.fault)
        try:
            for _ in range(self.max_tokens):
                await sim.engine.next_tokens(seq, [7] * self.width)
                self.times.append(sim.engine.clock.now())
            sim.engine.finish(seq, "length")
        except asyncio.CancelledError:
            sim.engine.abort(seq)
            raise

    @property
    def ttft(self) -> float:
        assert self.seq is not None
        return self.times[0] - self.seq.arrived

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def _sim(profile: str = "cpu-tiny", **kw: object) -> Simulator:
    return Simulator(SimConfig(profile=profile, **kw), VirtualClock())  # type: ignore[arg-type]


async def _until(cond: Callable[[], bool], spins: int = 10_000) -> None:
    """Let the loop run (the engine steps in model time) until `cond` holds."""
    for _ in range(spins):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def _run_all(streams: list[Stream]) -> None:
    for s in streams:
        s.start()
    await asyncio.gather(*(s.task for s in streams if s.task))


async def _mean_ttft(concurrent: int) -> float:
    sim = _sim()
    streams = [Stream(sim, 400, 4, seed=i) for i in range(concurrent)]
    await _run_all(streams)
    return statistics.mean(s.ttft for s in streams)


async def _mean_itl(batch: int) -> float:
    sim = _sim()
    streams = [Stream(sim, 16, 48, seed=i) for i in range(batch)]
    await _run_all(streams)
    return statistics.mean(x for s in streams for x in s.itls)


async def test_ttft_rises_with_concurrent_prompt_load() -> None:
    # cpu-tiny: 400-token prompts share one step's budget; past 4 (max_num_seqs) they
    # also wait for a slot. The shape bench/results/sim-shape compares with vLLM's.
    ttft = [await _mean_ttft(c) for c in (1, 2, 4, 8)]
    assert ttft == sorted(ttft)
    assert all(b > 1.2 * a for a, b in itertools.pairwise(ttft)), ttft


async def test_itl_rises_with_batch_size() -> None:
    itl = [await _mean_itl(b) for b in (1, 2, 4)]
    assert itl == sorted(itl)
    assert itl[-1] > 1.08 * itl[0], itl


async def test_long_prompt_is_chunked_and_decodes_stall_behind_it() -> None:
    sim = _sim("h100-8b", max_num_batched_tokens=2048)
    decoding = Stream(sim, 32, 60, seed=1).start()
    await _until(lambda: len(decoding.times) >= 10)
    steps_before = sim.engine.steps
    long = Stream(sim, 6000, 2, seed=2).start()
    await asyncio.gather(decoding.task, long.task)  # type: ignore[arg-type]
    itls = decoding.itls
    calm = statistics.median(itls)
    assert calm == pytest.approx(sim.profile.step_time(1, 1, 60), rel=0.1)
    # 6000 tokens under a 2048 budget shared with one decode: three prefill steps, each
    # compute-bound (~60 ms); the decoding stream gets a token from every one of them.
    stalled = [x for x in itls if x > 5 * calm]
    assert len(stalled) == 3
    # Its TTFT: the API server, the rest of the step in flight, the three chunks.
    front = sim.profile.frontend_s
    assert front + sum(stalled) < long.ttft < front + sum(stalled) + 2 * calm
    assert sim.engine.steps - steps_before >= 3 + 1  # the prefill chunks, then decodes
    assert sim.kv.used_blocks == 0


async def test_concurrent_prefills_share_the_step_budget() -> None:
    sim = _sim("h100-8b", max_num_batched_tokens=1024)
    a, b = Stream(sim, 1000, 1, seed=1), Stream(sim, 1000, 1, seed=2)
    await _run_all([a, b])
    # FIFO: the first prompt takes the budget, the second waits for what is left.
    assert a.ttft < b.ttft
    assert sim.engine.steps == 2
    alone = _sim("h100-8b", max_num_batched_tokens=1024)
    solo = Stream(alone, 1000, 1, seed=1)
    await _run_all([solo])
    front = alone.profile.frontend_s
    assert b.ttft - front > 1.8 * (solo.ttft - front)


async def test_n_choices_decode_in_one_step() -> None:
    sim = _sim("h100-8b")
    s = Stream(sim, 50, 10, width=3)
    await _run_all([s])
    assert s.seq is not None
    assert s.seq.generated == 30
    assert sim.engine.steps == 10  # the prefill emits the first round, then 9 decodes
    assert sim.stats.generated_tokens == 30


async def test_abort_mid_prefill_stops_scheduling_and_frees_blocks() -> None:
    sim = _sim("h100-8b", max_num_batched_tokens=512)
    s = Stream(sim, 4000, 1).start()
    await _until(lambda: sim.engine.steps >= 2)
    assert sim.kv.used_blocks > 0
    assert s.task is not None
    s.task.cancel()
    await asyncio.gather(s.task, return_exceptions=True)
    assert sim.kv.used_blocks == 0
    assert not sim.engine.running
    assert not sim.engine.waiting
    steps = sim.engine.steps
    for _ in range(50):
        await asyncio.sleep(0)
    assert sim.engine.steps <= steps + 1  # at most the step in flight when it left
    assert sim.engine._task is None  # idle: no loop task at all
    assert s.seq is not None
    assert s.seq.record.status == "aborted"


async def test_stalled_sequences_are_not_scheduled_until_their_time() -> None:
    sim = _sim("h100-8b")
    late = Stream(sim, 20, 3, fault="stall:500").start()
    slow = Stream(sim, 20, 4, fault="slow:100", seed=3).start()
    await asyncio.gather(late.task, slow.task)  # type: ignore[arg-type]
    assert late.ttft >= 0.5
    assert all(x >= 0.1 for x in slow.itls)
    assert slow.ttft < 0.05  # only the tokens after the first are slowed


async def test_stall_after_first_token_parks_without_steps() -> None:
    sim = _sim("h100-8b")
    stuck = Stream(sim, 20, 5, fault="stall").start()
    await _until(lambda: bool(stuck.times))
    steps = sim.engine.steps
    for _ in range(100):
        await asyncio.sleep(0)
    assert sim.engine.steps == steps  # parked: no step runs, the loop waits on its event
    assert len(sim.engine.running) == 1  # it keeps its slot and blocks, as a hung request
    assert stuck.task is not None
    stuck.task.cancel()
    await asyncio.gather(stuck.task, return_exceptions=True)
    assert sim.kv.used_blocks == 0


def _metric(sim: Simulator, name: str) -> float:
    text = sim.metrics.render().decode()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + "{"))


async def test_api_server_time_is_not_queue_time() -> None:
    # A request spends frontend_s in vLLM's API server, then waits in the scheduler's
    # queue: TTFT counts both, vllm:request_queue_time_seconds only the second.
    sim = _sim("h100-8b", max_num_seqs=1)
    first, second = Stream(sim, 100, 3, seed=1), Stream(sim, 100, 1, seed=2)
    await _run_all([first, second])
    front = sim.profile.frontend_s
    assert first.ttft > front
    queued = _metric(sim, "vllm:request_queue_time_seconds_sum")
    # The first is admitted as it arrives; the second waits for the first's 3 steps.
    assert queued == pytest.approx(first.times[-1] - first.seq.arrived - front, rel=0.01)  # type: ignore[union-attr]
    assert second.ttft > queued + front

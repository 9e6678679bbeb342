"""The engine core: one loop task running one scheduling step at a time, like vLLM's.

A request's serving task calls `add()`, then `next_tokens()` for each round of tokens
(one per live choice) and waits; `finish()`, `abort()` or `fail()` take it out. The loop
task asks the scheduler for a step (decodes plus chunked prefills under the token
budget, sim/scheduler.py), sleeps the step's time from the profile's latency model
(sim/profiles.py), then emits: every sequence whose step reached the end of its tokens
gets its tokens and its waiting task is woken (one future per round). Concurrent
prompts therefore share the step budget, and decodes wait behind the prefill chunks
scheduled with them. With no sequence the loop task ends; with sequences that cannot
run (a stalled stream, a busy client) it waits on an event, or on a timer for a fault
that holds a sequence back: it never polls.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
import time
from collections import deque

from sim.clock import Clock, RealClock
from sim.faults import Fault, FaultKind
from sim.kv import BlockManager, salted_root
from sim.metrics import SimMetrics
from sim.profiles import Profile
from sim.records import Counters, RequestLog, RequestRecord
from sim.scheduler import Batch, Scheduler
from sim.sequence import DONE, SeqStatus, Sequence

__all__ = ["Engine", "SeqStatus", "Sequence"]

log = logging.getLogger("sim.engine")


class Engine:
    def __init__(
        self,
        profile: Profile,
        max_num_seqs: int,
        kv: BlockManager,
        metrics: SimMetrics,
        records: RequestLog,
        stats: Counters,
        seed: int,
        max_num_batched_tokens: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.profile = profile
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self.kv = kv
        self.metrics = metrics
        self.records = records
        self.stats = stats
        self.clock: Clock = clock or RealClock()
        self.sched = Scheduler(kv, max_num_seqs, self.max_num_batched_tokens)
        self.steps = 0  # scheduling steps run
        self._rng = random.Random(seed * 1_000_003 + 17)  # step jitter
        self._wake = asyncio.Event()
        # (due, order, leaves the API server, sequence): one timer for the loop's wait
        self._timers: list[tuple[float, int, bool, Sequence]] = []
        self._tick = itertools.count()
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> deque[Sequence]:
        return self.sched.waiting

    @property
    def running(self) -> dict[Sequence, None]:
        return self.sched.running

    # -- lifecycle -------------------------------------------------------------------

    def add(
        self, record: RequestRecord, prompt_ids: list[int], fault: Fault | None, salt: str = ""
    ) -> Sequence:
        """Queue a request. Call from the task that will then call next_tokens().
        ``salt``: vLLM's ``cache_salt``, in the first block's hash, so the prefix
        cache is reused only between requests of one salt."""
        now = self.clock.now()
        seq = Sequence(record, prompt_ids, now, salted_root(salt))
        if fault is not None:
            if fault.kind is FaultKind.STALL and fault.arg is not None:
                seq.first_token_delay = fault.arg / 1000.0
                seq.not_before = now + seq.first_token_delay
                self._hold(seq.not_before, seq)
            elif fault.kind is FaultKind.STALL:
                seq.stall_after_first = True
            elif fault.kind is FaultKind.SLOW and fault.arg is not None:
                seq.itl_override = fault.arg / 1000.0
        record.status = SeqStatus.WAITING
        record.prompt_tokens = len(prompt_ids)
        self.records.add(record)
        self.stats.started += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        if self.profile.frontend_s > 0.0:
            # In the API server first: not in the scheduler's queue (nor its gauge) yet.
            self._hold(now + self.profile.frontend_s, seq, queue=True)
        else:
            self.sched.waiting.append(seq)
        self._kick()
        return seq

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence this long could ever hold its KV blocks."""
        return self.kv.blocks_for(num_tokens) <= self.kv.num_blocks

    async def next_token(self, seq: Sequence, token_id: int) -> None:
        """Wait until `seq` produces its next token (whose id is `token_id`)."""
        await self.next_tokens(seq, [token_id])

    async def next_tokens(self, seq: Sequence, token_ids: list[int]) -> None:
        """Wait for the step that produces `seq`'s next round: one token per live choice
        (their ids are `token_ids`), emitted together as vLLM's n sequences are."""
        if seq.status not in (SeqStatus.WAITING, SeqStatus.RUNNING):
            raise RuntimeError(f"sequence {seq.id} is {seq.status}")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq.pending = token_ids
        seq.future = fut
        if seq.not_before > self.clock.now():
            self._hold(seq.not_before, seq)
        elif seq.status is SeqStatus.RUNNING and not seq.parked:
            self.sched.ready[seq] = None
            self._wake.set()
        else:
            self._wake.set()  # a waiting one is picked up by the admission scan
        await fut

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq, SeqStatus.FINISHED, reason)

    def abort(self, seq: Sequence) -> None:
        self._release(seq, SeqStatus.ABORTED, "abort")

    def fail(self, seq: Sequence, reason: str = "error") -> None:
        self._release(seq, SeqStatus.FAILED, reason)

    # -- the loop --------------------------------------------------------------------

    def _kick(self) -> None:
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def _run(self) -> None:
        clock, sched = self.clock, self.sched
        try:
            while sched.has_work() or self._timers:
                self._release_due(clock.now())
                batch = sched.schedule(clock.now())
                if self.kv.events is not None:
                    self.kv.events.flush()  # the step's KV events, one batch (as vLLM)
                self._count_preemptions()
                if not batch:
                    self._wake.clear()
                    await clock.wait(self._wake, self._timers[0][0] if self._timers else None)
                    continue
                self._admitted(batch, clock.now())
                dt = self.profile.step_time(
                    batch.tokens, batch.rows, batch.context_tokens, self._rng
                )
                self.steps += 1
                await clock.sleep(dt)  # the forward pass; yields even when dt is 0
                self._emit(batch, clock.now())
                await asyncio.sleep(0)  # woken clients ask for their next round first
        except Exception as e:  # pragma: no cover - a bug: fail every waiting client
            log.exception("engine loop failed")
            for seq in (*sched.running, *sched.waiting):
                if seq.future is not None and not seq.future.done():
                    seq.future.set_exception(e)
        finally:
            self._task = None

    def _emit(self, batch: Batch, now: float) -> None:
        ready = self.sched.ready
        for seq, n in batch.items:
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted during the step: nothing to emit, its blocks are free
            seq.num_computed += n
            if seq.num_computed < len(seq.token_ids):
                ready[seq] = None  # a chunk of its prefill: the next one in a later step
                continue
            ids = seq.pending or []
            seq.pending = None
            seq.token_ids.extend(ids)
            self._count(seq, len(ids), now)
            fut, seq.future = seq.future, None
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _count(self, seq: Sequence, k: int, now: float) -> None:
        seq.generated += k
        rec = seq.record
        rec.generated_tokens = seq.generated
        seq.rounds += 1
        if seq.first_at is None:
            seq.first_at = now
            rec.first_token_at = time.time()
            rec.ttft_s = now - seq.arrived
            self.metrics.ttft.observe(now - seq.arrived)
            if seq.stall_after_first:
                seq.parked = True
        else:
            rec.tpot_s = (now - seq.first_at) / (seq.rounds - 1)
            self.metrics.itl.observe(now - seq.last_token)
        seq.last_token = now
        if seq.itl_override is not None:
            seq.not_before = now + seq.itl_override
        self.stats.generated_tokens += k
        self.metrics.generation_tokens.inc(k)

    def _admitted(self, batch: Batch, now: float) -> None:
        for seq, cached in batch.admitted:
            if not seq.queued:
                continue  # re-admitted after a preemption: counted once, like vLLM's
            seq.queued = False
            seq.record.cached_tokens = cached
            self.stats.cached_tokens += cached
            self.metrics.prefix_queries.inc(seq.num_prompt)
            self.metrics.prefix_hits.inc(cached)
            self.metrics.queue_time.observe(now - seq.enqueued)

    def _count_preemptions(self) -> None:
        for seq in self.sched.preempted:
            seq.record.preemptions += 1
            self.stats.preemptions += 1
            self.metrics.preemptions.inc()

    def _hold(self, due: float, seq: Sequence, queue: bool = False) -> None:
        """Wake the loop at `due` for `seq`: to queue it (`queue`: out of the API
        server), or because a fault held it until then."""
        heapq.heappush(self._timers, (due, next(self._tick), queue, seq))
        self._wake.set()  # the loop recomputes its deadline

    def _release_due(self, now: float) -> None:
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, queue, seq = heapq.heappop(timers)
            if queue:
                if seq.status is SeqStatus.WAITING:
                    seq.enqueued = now
                    self.sched.waiting.append(seq)
            elif seq.status is SeqStatus.RUNNING and seq.ready(now):
                self.sched.ready[seq] = None

    def _release(self, seq: Sequence, status: SeqStatus, reason: str) -> None:
        if seq.status in DONE:
            return
        self.sched.remove(seq)
        seq.status = status
        seq.pending = None
        rec = seq.record
        rec.status = status
        rec.finish_reason = reason
        now = time.time()
        if status is SeqStatus.ABORTED:
            rec.aborted_at = now
            self.stats.aborted += 1
            self.stats.aborted_tokens += seq.generated
        elif status is SeqStatus.FAILED:
            rec.finished_at = now
            self.stats.failed += 1
        else:
            rec.finished_at = now
            self.stats.finished += 1
        # vLLM counts aborts under request_success{finished_reason="abort"} too.
        self.metrics.success(reason)
        self.metrics.e2e.observe(self.clock.now() - seq.arrived)
        self._wake.set()  # slots and blocks were freed: waiting ones may fit now

"""Continuous-batching scheduler with a latency model, like vLLM's engine core.

Each request's tokens are produced in the task that serves it (`next_token`), so a
cancelled task (client gone) stops generating at once. The engine decides *when* each
token may appear: admission (at most max_num_seqs running, FIFO waiting queue, KV blocks
for the prompt), prefill time for uncached prompt tokens, then an inter-token latency
that grows with the number of running sequences. A running sequence that needs a new
KV block when none is free preempts the most recently admitted one (recompute, as vLLM
does), which goes back to the front of the waiting queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import deque
from enum import StrEnum

from sim.faults import Fault, FaultKind
from sim.kv import BlockManager, chain_hashes
from sim.metrics import SimMetrics
from sim.profiles import Profile
from sim.records import Counters, RequestLog, RequestRecord


class SeqStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


_DONE = (SeqStatus.FINISHED, SeqStatus.ABORTED, SeqStatus.FAILED)


class Sequence:
    def __init__(self, record: RequestRecord, prompt_ids: list[int], rng: random.Random) -> None:
        self.record = record
        self.token_ids = list(prompt_ids)  # prompt, then every generated token
        self.num_prompt = len(prompt_ids)
        self.status = SeqStatus.WAITING
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.generated = 0
        self.admit_order = 0
        self.rng = rng
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.arrived = asyncio.get_running_loop().time()
        self.last_token = 0.0
        self.prefill_s = 0.0  # prefill (or recompute) time, set at each admission
        self.needs_prefill = False
        self.queued = True  # first admission not yet done
        # Fault effects on timing.
        self.first_token_delay = 0.0
        self.itl_override: float | None = None
        self.stall_after_first = False

    @property
    def id(self) -> str:
        return self.record.id

    def is_running(self) -> bool:
        # A method, not an attribute test: preemption changes status across awaits.
        return self.status is SeqStatus.RUNNING


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
    ) -> None:
        self.profile = profile
        self.max_num_seqs = max_num_seqs
        self.kv = kv
        self.metrics = metrics
        self.records = records
        self.stats = stats
        self.seed = seed
        self.waiting: deque[Sequence] = deque()
        self.running: set[Sequence] = set()
        self._order = itertools.count(1)

    # -- lifecycle -------------------------------------------------------------------

    def add(self, record: RequestRecord, prompt_ids: list[int], fault: Fault | None) -> Sequence:
        """Queue a request. Call from the task that will then call next_token()."""
        n = next(self._order)
        seq = Sequence(record, prompt_ids, random.Random(self.seed * 1_000_003 + n))
        if fault is not None:
            if fault.kind is FaultKind.STALL and fault.arg is not None:
                seq.first_token_delay = fault.arg / 1000.0
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
        self.waiting.append(seq)
        self._schedule()
        return seq

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence this long could ever hold its KV blocks."""
        return self.kv.blocks_for(num_tokens) <= self.kv.num_blocks

    async def next_token(self, seq: Sequence, token_id: int) -> None:
        """Wait until `seq` produces its next token (whose id is `token_id`), then count it."""
        loop = asyncio.get_running_loop()
        while True:
            if seq.status is SeqStatus.WAITING:
                await seq.admitted
                continue
            if seq.status is not SeqStatus.RUNNING:
                raise RuntimeError(f"sequence {seq.id} is {seq.status}")
            if seq.needs_prefill:
                delay = seq.prefill_s + (seq.first_token_delay if seq.generated == 0 else 0.0)
                await _sleep(delay)
                if seq.is_running():
                    seq.needs_prefill = False
                    break  # the prefill (or recompute) step emits a token
                continue  # preempted during prefill
            if seq.stall_after_first:
                await loop.create_future()  # hang until the client goes away (cancel)
            itl = seq.itl_override
            if itl is None:
                itl = self.profile.itl(len(self.running), self.max_num_seqs, seq.rng)
            await _sleep(seq.last_token + itl - loop.time())
            if seq.is_running() and self._grow(seq):
                break
        self._emit(seq, token_id, loop.time())

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq, SeqStatus.FINISHED, reason)

    def abort(self, seq: Sequence) -> None:
        self._release(seq, SeqStatus.ABORTED, "abort")

    def fail(self, seq: Sequence, reason: str = "error") -> None:
        self._release(seq, SeqStatus.FAILED, reason)

    # -- internals -------------------------------------------------------------------

    def _emit(self, seq: Sequence, token_id: int, now: float) -> None:
        seq.generated += 1
        seq.token_ids.append(token_id)
        rec = seq.record
        rec.generated_tokens = seq.generated
        if seq.generated == 1:
            rec.first_token_at = time.time()
            self.metrics.ttft.observe(now - seq.arrived)
        else:
            self.metrics.itl.observe(now - seq.last_token)
        seq.last_token = now
        self.stats.generated_tokens += 1
        self.metrics.generation_tokens.inc()

    def _schedule(self) -> None:
        """Admit waiting sequences in FIFO order while slots and KV blocks allow."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._allocate(seq):
                break  # head-of-line blocking, as vLLM's FCFS policy does
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.record.status = SeqStatus.RUNNING
            seq.admit_order = next(self._order)
            self.running.add(seq)
            if not seq.admitted.done():
                seq.admitted.set_result(None)

    def _allocate(self, seq: Sequence) -> bool:
        bs = self.kv.block_size
        n = len(seq.token_ids)
        chain_hashes(seq.token_ids, bs, seq.hashes)
        # Never a full-prompt hit: at least the last token is computed.
        got = self.kv.allocate(seq.hashes, self.kv.blocks_for(n), (n - 1) // bs)
        if got is None:
            return False
        seq.blocks, hit_blocks = got
        cached = hit_blocks * bs
        seq.prefill_s = self.profile.prefill(n - cached)
        seq.needs_prefill = True
        if seq.queued:
            seq.queued = False
            seq.record.cached_tokens = cached
            self.stats.cached_tokens += cached
            self.metrics.prefix_queries.inc(n)
            self.metrics.prefix_hits.inc(cached)
            self.metrics.queue_time.observe(asyncio.get_running_loop().time() - seq.arrived)
        return True

    def _grow(self, seq: Sequence) -> bool:
        """KV slots for this decode step; False if `seq` itself was preempted."""
        bs = self.kv.block_size
        n = len(seq.token_ids)  # this step computes KV for every token so far
        while len(seq.blocks) < self.kv.blocks_for(n):
            block = self.kv.append()
            if block is not None:
                seq.blocks.append(block)
                continue
            victim = max(self.running, key=lambda s: s.admit_order)
            self._preempt(victim)
            if victim is seq:
                return False
        if n % bs == 0:
            chain_hashes(seq.token_ids, bs, seq.hashes)
            self.kv.register(seq.blocks[n // bs - 1], seq.hashes[n // bs - 1])
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.discard(seq)
        self.kv.free(seq.blocks)
        seq.blocks = []
        seq.status = SeqStatus.WAITING
        seq.record.status = SeqStatus.WAITING
        seq.record.preemptions += 1
        seq.admitted = asyncio.get_running_loop().create_future()
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        self.metrics.preemptions.inc()

    def _release(self, seq: Sequence, status: SeqStatus, reason: str) -> None:
        if seq.status in _DONE:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.discard(seq)
            self.kv.free(seq.blocks)
            seq.blocks = []
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        seq.status = status
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
        self.metrics.e2e.observe(asyncio.get_running_loop().time() - seq.arrived)
        self._schedule()


async def _sleep(delay: float) -> None:
    # sleep(0) still yields, so a zero-latency profile interleaves all streams.
    await asyncio.sleep(delay if delay > 0.0 else 0)

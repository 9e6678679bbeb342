"""One scheduling step, the way vLLM's v1 scheduler builds it.

Running sequences first, in admission order: each ready one gets what it still needs
(one token for a decode; the rest of its prompt, or as much as the budget allows, for
a chunked prefill), its KV slots allocated for exactly that. A running sequence that
needs a block when none is free preempts the most recently admitted running sequence
(recompute: it frees its blocks and goes back to the front of the waiting queue). Then,
if nothing was preempted, waiting sequences in FIFO order while fewer than
`max_num_seqs` run and budget is left: prefix-cache hits are skipped, the first chunk
is allocated, and a sequence that does not fit stops admission (head-of-line blocking,
as vLLM's FCFS policy). Only what the step schedules is visited, plus waiting
sequences a fault holds back.
"""

from __future__ import annotations

import contextlib
from collections import deque
from operator import attrgetter

from sim.kv import BlockManager, chain_hashes
from sim.sequence import SeqStatus, Sequence

_BY_ADMISSION = attrgetter("admit_order")


class Batch:
    """What one step runs: (sequence, tokens it computes) pairs and the step's shape."""

    __slots__ = ("admitted", "context_tokens", "items", "rows", "tokens")

    def __init__(self) -> None:
        self.items: list[tuple[Sequence, int]] = []
        self.tokens = 0  # scheduled tokens (prefill chunks and decodes)
        self.rows = 0  # sequences in the forward pass (a request with n choices: n)
        self.context_tokens = 0  # tokens of KV the step's attention reads
        self.admitted: list[tuple[Sequence, int]] = []  # (newly admitted, cached tokens)

    def add(self, seq: Sequence, n: int) -> None:
        self.items.append((seq, n))
        self.tokens += n
        k = seq.width()
        self.rows += k
        # n choices each read the prompt and their own tokens: about k prompts' worth.
        self.context_tokens += seq.num_computed + n + (k - 1) * seq.num_prompt

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, kv: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Sequence, None] = {}  # admission order: the last is preempted
        self.ready: dict[Sequence, None] = {}  # running sequences a step may run now
        self.preempted: list[Sequence] = []  # by the last schedule() call
        self._order = 0

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self, now: float) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens
        self.preempted = []
        if self.ready:
            for seq in sorted(self.ready, key=_BY_ADMISSION):
                if budget <= 0:
                    break
                if seq.status is not SeqStatus.RUNNING:
                    continue  # preempted by a sequence ahead of it in this step
                n = min(len(seq.token_ids) - seq.num_computed, budget)
                if not self._grow(seq, n):
                    break  # it preempted itself: vLLM stops scheduling running ones
                del self.ready[seq]
                batch.add(seq, n)
                budget -= n
        if not self.preempted:
            self._admit_waiting(batch, budget, now)
        return batch

    def preempt(self, seq: Sequence) -> None:
        del self.running[seq]
        self.ready.pop(seq, None)
        self.kv.free(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.record.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preempted.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Out of the engine (finished, aborted, failed): its blocks are freed at once."""
        if seq.status is SeqStatus.RUNNING:
            del self.running[seq]
            self.ready.pop(seq, None)
            self.kv.free(seq.blocks)
            seq.blocks = []
        elif seq.status is SeqStatus.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)

    # -- internals -------------------------------------------------------------------

    def _admit_waiting(self, batch: Batch, budget: int, now: float) -> None:
        skipped: list[Sequence] = []
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[0]
            if not seq.ready(now):
                skipped.append(waiting.popleft())  # held by a fault, or its client is busy
                continue
            n = self._admit(seq, budget, batch)
            if n == 0:
                break  # does not fit: head-of-line blocking
            waiting.popleft()
            batch.add(seq, n)
            budget -= n
        if skipped:
            waiting.extendleft(reversed(skipped))

    def _admit(self, seq: Sequence, budget: int, batch: Batch) -> int:
        kv, bs = self.kv, self.kv.block_size
        total = len(seq.token_ids)
        chain_hashes(seq.token_ids, bs, seq.hashes, seq.root)
        # Never a full hit: at least the last token is computed.
        hits = kv.cached_prefix(seq.hashes, (total - 1) // bs)
        computed = hits * bs
        n = min(total - computed, budget)
        end = computed + n
        got = kv.allocate(seq.hashes[: end // bs], kv.blocks_for(end), hits, seq.token_ids)
        if got is None:
            return 0
        seq.blocks, _ = got
        seq.num_computed = computed
        seq.status = SeqStatus.RUNNING
        seq.record.status = SeqStatus.RUNNING
        self._order += 1
        seq.admit_order = self._order
        self.running[seq] = None
        batch.admitted.append((seq, computed))
        return n

    def _grow(self, seq: Sequence, n: int) -> bool:
        """KV slots for `n` more tokens of a running sequence, preempting the most
        recently admitted running sequences while none are free; False if `seq` itself
        was preempted."""
        kv, bs = self.kv, self.kv.block_size
        end = seq.num_computed + n
        while len(seq.blocks) < kv.blocks_for(end):
            block = kv.append()
            if block is not None:
                seq.blocks.append(block)
                continue
            victim = next(reversed(self.running))
            self.preempt(victim)
            if victim is seq:
                return False
        first, last = seq.num_computed // bs, end // bs
        if last > first:  # blocks this step fills become cacheable (vLLM caches at schedule)
            chain_hashes(seq.token_ids, bs, seq.hashes, seq.root)
            for i in range(first, last):
                parent = seq.hashes[i - 1] if i else None
                tokens = seq.token_ids[i * bs : (i + 1) * bs]
                kv.register(seq.blocks[i], seq.hashes[i], parent, tokens)
        return True

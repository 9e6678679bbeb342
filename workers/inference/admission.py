"""KV-headroom admission: how many requests this worker may hold at once.

A worker pulls a message only after it has a slot. A slot exists while
(a) in-flight requests < ``max_inflight`` (the engine's ``max_num_seqs``), and
(b) the KV blocks reserved for in-flight requests (prompt + max output, rounded
up to blocks), plus one typical request, stay under ``target_util`` of the
engine's blocks, and (c) the engine itself reports no waiting queue and KV use
under target (the correction for what our estimate misses: other clients,
prefix sharing, preemption).

An engine without a KV cache to speak of (a pooling model: vLLM reports one
block for an encoder-only model) is admitted by slots and the engine's waiting
queue alone; budgeting its one block would leave no slot at all.

Once pulled, a request counts as itself: its own prompt + max_tokens is
reserved (:meth:`Admission.reserve_blocks`), and one that would overrun the
budget waits for blocks to free, in arrival order (a large request is not
overtaken forever by small ones), unless nothing else is reserved (alone, it
runs: the engine preempts or recomputes, as vLLM does).

Classes are ranked, and split without preemption (what runs, runs to its end):

- a lower-ranked class takes a slot only while ``reserve`` more stay free and
  no top-class puller has waited for one in the last ``starve_after`` seconds
  (its excess puller polling an empty subject is not asking for work),
  so interactive work gets every slot it asks for first, and batch uses only
  capacity interactive has left idle a while (a slot batch takes is held to its
  end: taking one in a lull of an interactive burst delays the burst);
- batch is never starved: a lower class that has waited ``starve_after``
  seconds may take the next free slot, but only while the lower classes' share
  of the slots, averaged over the last ``SHARE_WINDOW_S``, is under
  ``lower_share``, and they hold fewer than ``lower_share`` of ``max_inflight``
  (at least one) now; the top class leaves a slot free for it meanwhile. So
  under contention the lower classes get about ``lower_share`` of the
  capacity, whatever the slot count: a share of time, not a whole slot (with 4
  slots, one slot is 25 %).

(Before this split a starved lower class competed for every slot as an equal,
and under saturation it was always starved: a half-batch mix doubled
interactive TTFT.)

Within a class, tenants: a class's excess subject carries what gateways held
back from tenants over their turn (gateway/inference/fair_gate.py). Its puller
takes a slot by its class's rule, and only while no in-turn puller of its class
or a higher one waits for a slot. The in-turn puller holds its slot while it
polls, so a tenant sending in turn finds a puller ready while another floods:
its request starts at once instead of after the flood's queue. With
``max_inflight`` of 16 or more the excess also leaves ``max_inflight // 16``
slots free beyond that one (``in_turn_spare``): a second request in turn that
comes while the first has just taken the polling puller's slot finds the next
one ready, instead of waiting for a running request to end. The flood pays
1/16 of the slots for it; with fewer than 16 slots that would be a quarter or
more, so there is none. While requests in turn run, the cushion grows by one
per running request, up to twice the spare (and never past half the slots):
the tenants in turn that are busy now are the likeliest to send again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from workers.engines.base import EngineLoad
from workers.errors import WorkerStopping


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 16
    target_util: float = 0.9
    num_gpu_blocks: int | None = None  # None: learn from the engine's metrics
    block_size: int = 16
    typical_tokens: int = 1024  # expected prompt + output before the message is read
    reserve: int = 1
    lower_share: float = 0.05  # the lower classes' floor under contention (issue 15)
    starve_after: float = 1.0
    in_turn_spare: int | None = None  # None: max_inflight // 16 (see above)

    def spare(self) -> int:
        """Slots a class's excess leaves free beyond the in-turn puller's own."""
        return self.max_inflight // 16 if self.in_turn_spare is None else self.in_turn_spare


SHARE_WINDOW_S = 10.0  # the lower classes' share of the slots is averaged over this


class Admission:
    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float] | None = None) -> None:
        self.cfg = cfg
        # For the lower classes' share of time (a test passes its own).
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self.num_gpu_blocks = cfg.num_gpu_blocks
        self.block_size = cfg.block_size
        self.held = 0  # slots held: polling fetchers and in-flight requests
        self.held_lower = 0  # of those, by lower-ranked classes
        self.held_excess = 0  # of those, by excess pullers
        self.top_waiters = 0  # top-class pullers waiting for a slot now (not idle excess)
        self.in_turn_waiters: collections.Counter[int] = collections.Counter()  # by rank
        # Waiters with work in sight (a lane's room, a held message, a puller whose
        # last pull brought something), by rank: an idle puller yields to them.
        self.eager_waiters: collections.Counter[int] = collections.Counter()
        self._top_waited_at = -math.inf  # loop time a top-class puller last waited
        self.starved_lower = 0  # lower-class pullers past starve_after, waiting now
        self.waiters = 0  # pull loops and held messages waiting for room now
        self._block_queue: collections.deque[object] = collections.deque()  # arrival order
        self.reserved_blocks = 0
        self.engine = EngineLoad()
        self._cond = asyncio.Condition()
        self._closed = False
        self._lower_avg = 0.0  # decayed mean of held_lower / max_inflight
        self._lower_at: float | None = None  # loop time of its last update

    def blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_size))

    def _typical_blocks(self) -> int:
        return self.blocks_for(self.cfg.typical_tokens)

    def free_slots(self) -> int:
        if self._block_queue:
            return 0  # a pulled request waits for blocks: pulling more would queue here
        free = min(self.cfg.max_inflight - self.held, self._block_slots())
        if self._engine_busy() and self.held > 0:
            # The engine is queueing already: pulling more only moves the queue
            # from JetStream (where other workers can take it) into one engine.
            return 0
        return max(0, free)

    def _block_slots(self) -> int:
        """Typical requests the KV budget still fits (without a budget, the slots bound it)."""
        if not self.num_gpu_blocks:
            return self.cfg.max_inflight
        budget = int(self.num_gpu_blocks * self.cfg.target_util) - self.reserved_blocks
        return budget // self._typical_blocks()

    def _engine_busy(self) -> bool:
        eng = self.engine
        return (eng.waiting or 0) > 0 or (eng.kv_usage or 0.0) >= self.cfg.target_util

    def engine_has_room(self) -> bool:
        """The engine queues nothing, its KV use is under target and the KV budget
        fits another typical request: only the slot count could hold a worker
        back now (see ``Worker`` on ``jetserve_worker_capped_seconds``)."""
        return not self._block_queue and not self._engine_busy() and self._block_slots() > 0

    def headroom(self) -> float:
        """Share of the engine's KV blocks not reserved here (1.0 when unknown)."""
        if not self.num_gpu_blocks:
            return 1.0
        return max(0.0, 1 - self.reserved_blocks / self.num_gpu_blocks)

    def lower_floor(self) -> int:
        return max(1, math.ceil(self.cfg.lower_share * self.cfg.max_inflight))

    def lower_share_recent(self) -> float:
        """The lower classes' share of the slots over about the last SHARE_WINDOW_S."""
        self._advance_share()
        return self._lower_avg

    def _advance_share(self) -> None:
        """Fold the time since the last change in at the share held meanwhile
        (called before ``held_lower`` changes, and to read it)."""
        now = self._clock()
        if self._lower_at is not None:
            keep = math.exp(-(now - self._lower_at) / SHARE_WINDOW_S)
            held = self.held_lower / self.cfg.max_inflight
            self._lower_avg = self._lower_avg * keep + held * (1 - keep)
        self._lower_at = now

    def _below_floor(self) -> bool:
        return (
            self.held_lower < self.lower_floor()
            and self.lower_share_recent() < self.cfg.lower_share
        )

    def _room(self, rank: int, starved: bool) -> bool:
        """Whether a puller of ``rank`` may have a slot now (the class split above)."""
        free = self.free_slots()
        below_floor = self._below_floor()
        if rank == 0:
            return free >= (2 if self.starved_lower and below_floor else 1)
        if starved and below_floor:
            return free >= 1
        return free >= 1 + self.cfg.reserve and not self._top_busy()

    def _excess_room(self, rank: int, starved: bool, idle: bool = False) -> bool:
        """A class's excess: by its class's rule, while no in-turn request of the
        class or a higher one waits for a slot; while its queue was empty at the
        last look (``idle``), only while ``reserve`` more stay free, so that
        polling an empty excess does not take a saturated class's last slot.
        With one slot, which the in-turn
        puller holds while it polls, the excess may have one more (the engine
        then queues an in-turn request behind it, as without the split)."""
        if any(self.in_turn_waiters[r] for r in range(rank + 1)):
            return False
        if self.cfg.max_inflight == 1:
            return not self._closed and self.held_excess == 0 and self.held <= 1
        free = self.free_slots()
        if free < self._in_turn_cushion() or (idle and free < 1 + self.cfg.reserve):
            return False
        return self._room(rank, starved)

    def _in_turn_cushion(self) -> int:
        """Free slots the excess leaves: the in-turn puller's, the spare, and one
        more per in-turn request running (up to twice the spare), never more
        than half the slots. A tenant in turn that has requests running is the
        likeliest to send the next: with a fixed cushion its third request in a
        burst waited for one of the flood's to end (issue 15's p99)."""
        spare = self.cfg.spare()
        running = max(0, self.held - self.held_excess - 1)  # less the polling puller
        need = 1 + spare + min(running, 2 * spare)
        return min(need, max(1 + spare, self.cfg.max_inflight // 2))

    def _yields(self, rank: int, idle: bool) -> bool:
        """Whether a puller whose last pull found nothing (``idle``) lets a slot go
        to an eager waiter of its rank or above that could take it now. A release
        wakes the waiters, but the releasing puller, looping straight back, would
        otherwise take the slot again before any of them runs: with as many
        polling pullers as slots, a lane's messages (or a held one) never started
        while the class's own empty subject was polled (issue 14, FIFO)."""
        return idle and any(self.eager_waiters[r] and self._room(r, False) for r in range(rank + 1))

    def _top_busy(self) -> bool:
        if self.top_waiters:
            return True
        now = asyncio.get_running_loop().time()
        return now - self._top_waited_at < self.cfg.starve_after

    def _take(self, rank: int, excess: bool = False) -> None:
        if rank > 0:
            self._advance_share()
        self.held += 1
        self.held_lower += rank > 0
        self.held_excess += excess

    async def acquire(self, rank: int, excess: bool = False, idle: bool = False) -> bool:
        """Wait for a slot; rank 0 is the top class, ``excess`` its excess
        subject's puller (``idle``: its last pull found nothing). False once closed."""
        return await self._await_room(rank, take=True, excess=excess, idle=idle)

    async def wait_room(self, rank: int) -> bool:
        """Wait until a slot is free without taking it (pull requests may go out
        while one could be served); False once closed."""
        return await self._await_room(rank, take=False)

    async def _await_room(
        self, rank: int, *, take: bool, excess: bool = False, idle: bool = False
    ) -> bool:
        loop = asyncio.get_running_loop()
        since = loop.time()
        counted_starved = False
        async with self._cond:
            try:
                while not self._closed:
                    # (An excess is never starved: the floor is for the class's
                    # requests in turn; counted, it would hold a slot free for a
                    # puller that yields it to the very waiter holding it free.)
                    starved = (
                        rank > 0 and not excess and loop.time() - since >= self.cfg.starve_after
                    )
                    if starved and not counted_starved:
                        self.starved_lower += 1
                        counted_starved = True
                    if (
                        self._excess_room(rank, starved, idle)
                        if excess
                        else self._room(rank, starved) and not self._yields(rank, idle)
                    ):
                        if take:
                            self._take(rank, excess)
                        return True
                    # Wake periodically: starvation is a function of time, not events.
                    await self._wait(rank, excess, idle)
                return False
            finally:
                if counted_starved:
                    self.starved_lower -= 1

    async def _wait(self, rank: int, excess: bool = False, idle: bool = False) -> None:
        """One wait for a change (or a quarter of ``starve_after``), counted in
        ``waiters`` (and ``top_waiters``, ``in_turn_waiters``, ``eager_waiters``);
        the condition's lock is held."""
        eager = not excess and not idle
        # An excess polling an empty subject is no top-class demand: counted, it
        # held every lower class back for starve_after whenever a moment's
        # scarcity made it wait (an embedding worker then sat idle half the time).
        top = rank == 0 and not (excess and idle)
        self.waiters += 1
        self.top_waiters += top
        self.in_turn_waiters[rank] += not excess
        self.eager_waiters[rank] += eager
        if top:
            self._top_waited_at = asyncio.get_running_loop().time()
        try:
            # (asyncio.timeout, not wait_for: on 3.11 that can drop a cancel.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.starve_after / 4):
                    await self._cond.wait()
        finally:
            self.waiters -= 1
            self.top_waiters -= top
            self.in_turn_waiters[rank] -= not excess
            self.eager_waiters[rank] -= eager
            if top:
                self._top_waited_at = asyncio.get_running_loop().time()

    def try_acquire(self, rank: int, excess: bool = False, idle: bool = False) -> bool:
        """A slot now or never (a message already in hand: the lane puller)."""
        if excess:
            room = self._excess_room(rank, False, idle)
        else:
            room = self._room(rank, False) and not self._yields(rank, idle)
        if self._closed or not room:
            return False
        self._take(rank, excess)
        return True

    async def release(self, blocks: int = 0, rank: int = 0, excess: bool = False) -> None:
        async with self._cond:
            if rank > 0:
                self._advance_share()
            self.held -= 1
            self.held_lower -= rank > 0
            self.held_excess -= excess
            self.reserved_blocks -= blocks
            self._cond.notify_all()

    def _fits(self, blocks: int) -> bool:
        if not self.num_gpu_blocks or not self.reserved_blocks:
            return True
        return self.reserved_blocks + blocks <= int(self.num_gpu_blocks * self.cfg.target_util)

    def fits_now(self, tokens: int) -> bool:
        """Whether :meth:`reserve_blocks` would return at once."""
        return not self._block_queue and self._fits(self.blocks_for(tokens))

    async def reserve_blocks(self, tokens: int) -> int:
        """Reserve this request's blocks (``tokens`` = its prompt + max_tokens),
        waiting in arrival order while they would overrun the budget; raise
        :class:`WorkerStopping` if admission closes first (a stopping worker
        hands its waiters back rather than hold them through its drain)."""
        blocks = self.blocks_for(tokens)
        me = object()
        async with self._cond:
            self._block_queue.append(me)
            try:
                while not (self._block_queue[0] is me and self._fits(blocks)):
                    if self._closed:
                        raise WorkerStopping("the worker stopped before the request's KV blocks")
                    await self._cond.wait()  # a release, an observation or close notifies
                self.reserved_blocks += blocks
            finally:
                self._block_queue.remove(me)
                self._cond.notify_all()
        return blocks

    async def observe(self, load: EngineLoad) -> None:
        async with self._cond:
            if load.block_size:
                self.block_size = load.block_size
            if self._kv_less(load):
                # A pooling (embedding) model: vLLM reports one block, and its
                # usage says nothing of room. Slots and the waiting queue decide.
                self.num_gpu_blocks = self.cfg.num_gpu_blocks
                load = dataclasses.replace(load, kv_usage=None, num_gpu_blocks=None)
            elif self.cfg.num_gpu_blocks is None and load.num_gpu_blocks:
                self.num_gpu_blocks = load.num_gpu_blocks
            self.engine = load
            self._cond.notify_all()

    def _kv_less(self, load: EngineLoad) -> bool:
        """An engine whose KV cache cannot hold one typical request has none to
        budget (an encoder-only model: vLLM's pooling runner reports
        ``num_gpu_blocks=1``); a configured block count still applies."""
        if self.cfg.num_gpu_blocks is not None or not load.num_gpu_blocks:
            return False
        return load.num_gpu_blocks * self.block_size < self.cfg.typical_tokens

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    def slots(self, rank: int, excess: bool = False) -> RankSlots:
        """One class's view of the slots (``excess``: its excess subject's), for
        its pull loop (``streams.consumer.Slots``)."""
        return RankSlots(self, rank, excess)


@dataclass(frozen=True)
class RankSlots:
    admission: Admission
    rank: int
    excess: bool = False

    async def acquire(self, idle: bool = False) -> bool:
        return await self.admission.acquire(self.rank, self.excess, idle)

    def try_acquire(self, idle: bool = False) -> bool:
        return self.admission.try_acquire(self.rank, self.excess, idle)

    async def release(self) -> None:
        await self.admission.release(rank=self.rank, excess=self.excess)

"""KV-headroom admission: how many requests this worker may hold at once.

A worker pulls a message only after it has a slot. A slot exists while
(a) in-flight requests < ``max_inflight`` (the engine's ``max_num_seqs``), and
(b) the KV blocks reserved for in-flight requests (prompt + max output, rounded
up to blocks), plus one typical request, stay under ``target_util`` of the
engine's blocks, and (c) the engine itself reports no waiting queue and KV use
under target (the correction for what our estimate misses: other clients,
prefix sharing, preemption).

Classes are ranked; a lower-ranked class leaves ``reserve`` slots for the top
one unless it has waited longer than ``starve_after`` seconds, so interactive
work is preferred and batch is never starved.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass

from workers.engines.base import EngineLoad


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 16
    target_util: float = 0.9
    num_gpu_blocks: int | None = None  # None: learn from the engine's metrics
    block_size: int = 16
    typical_tokens: int = 1024  # expected prompt + output before the message is read
    reserve: int = 1
    starve_after: float = 1.0


class Admission:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.num_gpu_blocks = cfg.num_gpu_blocks
        self.block_size = cfg.block_size
        self.held = 0  # slots held: polling fetchers and in-flight requests
        self.waiters = 0  # pull loops and held messages waiting for room now
        self.reserved_blocks = 0
        self.engine = EngineLoad()
        self._cond = asyncio.Condition()
        self._closed = False

    def blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_size))

    def _typical_blocks(self) -> int:
        return self.blocks_for(self.cfg.typical_tokens)

    def free_slots(self) -> int:
        free = self.cfg.max_inflight - self.held
        if self.num_gpu_blocks:
            budget = int(self.num_gpu_blocks * self.cfg.target_util) - self.reserved_blocks
            free = min(free, budget // self._typical_blocks())
        eng = self.engine
        engine_busy = (eng.waiting or 0) > 0 or (eng.kv_usage or 0.0) >= self.cfg.target_util
        if engine_busy and self.held > 0:
            # The engine is queueing already: pulling more only moves the queue
            # from JetStream (where other workers can take it) into one engine.
            return 0
        return max(0, free)

    def headroom(self) -> float:
        """Share of the engine's KV blocks not reserved here (1.0 when unknown)."""
        if not self.num_gpu_blocks:
            return 1.0
        return max(0.0, 1 - self.reserved_blocks / self.num_gpu_blocks)

    async def acquire(self, rank: int) -> bool:
        """Wait for a slot; rank 0 is the top class. False once closed."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        async with self._cond:
            while not self._closed:
                starved = loop.time() - since >= self.cfg.starve_after
                need = 1 if rank == 0 or starved else 1 + self.cfg.reserve
                if self.free_slots() >= need:
                    self.held += 1
                    return True
                # Wake periodically: starvation is a function of time, not events.
                await self._wait()
            return False

    async def _wait(self) -> None:
        """One wait for a change (or a quarter of ``starve_after``), counted in
        ``waiters``; the condition's lock is held."""
        self.waiters += 1
        try:
            # (asyncio.timeout, not wait_for: on 3.11 that can drop a cancel.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.starve_after / 4):
                    await self._cond.wait()
        finally:
            self.waiters -= 1

    def try_acquire(self, rank: int) -> bool:
        """A slot now or never (a message already in hand: the lane puller)."""
        need = 1 if rank == 0 else 1 + self.cfg.reserve
        if self._closed or self.free_slots() < need:
            return False
        self.held += 1
        return True

    async def wait_room(self, rank: int) -> bool:
        """Wait until a slot is free without taking it (pull requests may go out
        while one could be served); False once closed."""
        async with self._cond:
            while not self._closed:
                need = 1 if rank == 0 else 1 + self.cfg.reserve
                if self.free_slots() >= need:
                    return True
                await self._wait()
            return False

    async def release(self, blocks: int = 0) -> None:
        async with self._cond:
            self.held -= 1
            self.reserved_blocks -= blocks
            self._cond.notify_all()

    async def reserve_blocks(self, tokens: int) -> int:
        blocks = self.blocks_for(tokens)
        async with self._cond:
            self.reserved_blocks += blocks
        return blocks

    async def observe(self, load: EngineLoad) -> None:
        async with self._cond:
            self.engine = load
            if self.cfg.num_gpu_blocks is None and load.num_gpu_blocks:
                self.num_gpu_blocks = load.num_gpu_blocks
            if load.block_size:
                self.block_size = load.block_size
            self._cond.notify_all()

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    def slots(self, rank: int) -> RankSlots:
        """One class's view of the slots, for its pull loop (``streams.consumer.Slots``)."""
        return RankSlots(self, rank)


@dataclass(frozen=True)
class RankSlots:
    admission: Admission
    rank: int

    async def acquire(self) -> bool:
        return await self.admission.acquire(self.rank)

    def try_acquire(self) -> bool:
        return self.admission.try_acquire(self.rank)

    async def release(self) -> None:
        await self.admission.release()

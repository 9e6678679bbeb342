"""A worker's part of the fleet-wide KV index: it follows its engine's KV events
(workers/inference/kv_events.py), keeps what they mean in prefix keys
(workers/inference/kv_tracker.py) and tells the gateways on
``jetserve.kvidx`` (streams/kv_index.py): changes every ``flush_s``, and
everything it holds every ``refresh_s`` (a gateway that started late, or missed
a delta on core NATS, catches up; one that stops hearing it forgets it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client

from streams.kv_index import KV_INDEX_SUBJECT, KvIndexDelta, encode_delta
from workers.inference.kv_events import KvEventFeed
from workers.inference.kv_tracker import KvTracker

log = logging.getLogger(__name__)

FLUSH_S = 0.1
REFRESH_S = 5.0


class KvReporter:
    def __init__(
        self,
        nc: Client,
        replica: str,
        endpoint: str,
        topic: str = "",
        flush_s: float = FLUSH_S,
        refresh_s: float = REFRESH_S,
        outcome: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self._nc = nc
        self.replica = replica
        self.tracker = KvTracker(outcome)
        self.feed = KvEventFeed(endpoint, self.tracker.apply, self.tracker.reset, topic)
        self._flush = flush_s
        self._refresh = refresh_s
        self.deltas = 0  # published

    async def run(self) -> None:
        """Follow the events and publish until cancelled; then tell the gateways
        this replica holds nothing (membership tells them too, when it leaves)."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.feed.run())
                tg.create_task(self._publish())
        finally:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._send(KvIndexDelta(self.replica, refresh=True))

    async def _publish(self) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + self._refresh
        while True:
            await asyncio.sleep(self._flush)
            self.tracker.expire()
            try:
                if loop.time() >= next_refresh:
                    self.tracker.take()  # the refresh says all of it
                    await self._send(KvIndexDelta(self.replica, self.tracker.held(), refresh=True))
                    next_refresh = loop.time() + self._refresh
                    continue
                added, removed = self.tracker.take()
                if added or removed:
                    await self._send(KvIndexDelta(self.replica, added, removed))
            except (nats.errors.Error, TimeoutError) as exc:
                # At most once, as the bus is: the next refresh repairs it.
                log.warning("kv index delta not published: %r", exc)

    async def _send(self, delta: KvIndexDelta) -> None:
        await self._nc.publish(KV_INDEX_SUBJECT, encode_delta(delta))
        self.deltas += 1

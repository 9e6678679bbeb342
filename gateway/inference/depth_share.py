"""One queue-depth reader for the fleet, elected by lease.

Each look at the queues lists every consumer of the work-queue stream (a few
pages at a few hundred lanes a class): cheap for one gateway, but a fleet of G
gateways looking twice a second puts 2·G lists a second into the JetStream API
queue (docs/scale.md). So one gateway, holding the ``depth-reader`` lease
(streams/leases.py), looks and publishes each look on ``DEPTH_SUBJECT``; the
others take their numbers from there and look at nothing themselves.

- The reader renews its lease and republishes its last look every ``renew_s``
  (a heartbeat), so a follower that hears nothing for the lease's ttl knows the
  reader is gone and tries the lease itself: a dead reader is replaced within
  about ``3 · renew_s``, and meanwhile followers keep its last numbers.
- A heartbeat is the last look again, its time unchanged: a follower notes the
  reader alive and takes nothing from it (no new numbers).
- A follower's own publish may end an idle spell the reader does not know of
  (it looks seldom while idle): the follower nudges it on ``DEPTH_POKE_SUBJECT``,
  at most once a look interval, and only while the numbers it holds say idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError

from streams.depth import (
    DEPTH_POKE_SUBJECT,
    DEPTH_SUBJECT,
    LOOK_ENCODER,
    DepthLook,
    decode_look,
)
from streams.leases import KvLease
from streams.tasks import stop_task

log = logging.getLogger(__name__)

LEASE_KEY = "depth-reader"
RENEW_S = 2.0


class DepthShare:
    """This gateway's part in the election: reader or follower."""

    def __init__(
        self,
        nc: Client,
        reader_id: str,
        lease: Callable[[], Awaitable[KvLease]],
        on_look: Callable[[DepthLook], None],
        on_poke: Callable[[], None],
        renew_s: float = RENEW_S,
    ) -> None:
        self._nc = nc
        self.reader_id = reader_id
        self._make_lease = lease
        self._lease: KvLease | None = None
        self._on_look = on_look
        self._on_poke = on_poke
        self.renew_s = renew_s
        self.leading = False
        self.led = asyncio.Event()  # set while this gateway is the reader
        self._heard_at = 0.0  # monotonic; the last look heard from another reader
        self._poked_at = 0.0
        self._last: DepthLook | None = None  # the last look this gateway published
        self._taken_from = ""  # the reader of the newest look heard and taken
        self._taken_at = 0.0  # its time (that reader's clock)
        self._subs: list[Subscription] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def ttl_s(self) -> float:
        return 3 * self.renew_s

    async def start(self) -> None:
        self._subs = [
            await self._nc.subscribe(DEPTH_SUBJECT, cb=self._heard),
            await self._nc.subscribe(DEPTH_POKE_SUBJECT, cb=self._poked),
        ]
        self._task = asyncio.create_task(self._elect(), name="depth-election")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if self._lease is not None:
            await self._lease.release()  # a follower takes over at its next try
        self._set_leading(False)

    async def publish(self, look: DepthLook) -> None:
        """The reader's look, for the followers (best effort: core NATS)."""
        self._last = look
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(DEPTH_SUBJECT, LOOK_ENCODER.encode(self._last))

    async def poke(self, idle: bool) -> None:
        """A follower's publish: nudge the reader if the numbers held say idle."""
        now = time.monotonic()
        if self.leading or not idle or now - self._poked_at < self.renew_s / 4:
            return
        self._poked_at = now
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(DEPTH_POKE_SUBJECT, b"")

    async def _elect(self) -> None:
        while True:
            with contextlib.suppress(nats.errors.Error, TimeoutError, APIError):
                await self._round()
            await asyncio.sleep(self.renew_s)

    async def _round(self) -> None:
        if not self.leading and time.monotonic() - self._heard_at < self.ttl_s:
            return  # a reader is alive: nothing to do
        if self._lease is None:
            self._lease = await self._make_lease()
        self._set_leading(await self._lease.hold())
        if self.leading and self._last is not None:
            await self.publish(self._last)  # the heartbeat (its time unchanged)

    def _set_leading(self, leading: bool) -> None:
        if leading != self.leading:
            log.info(
                "depth reader",
                extra={"event": "depth_reader", "reader": self.reader_id, "leading": leading},
            )
        self.leading = leading
        if leading:
            self.led.set()
        else:
            self.led.clear()

    async def _heard(self, msg: Msg) -> None:
        look = decode_look(msg.data)
        if look is None or look.reader == self.reader_id:
            return
        # Heard while leading: a renewal of ours was late and another took the
        # lease; our next renewal fails and settles it. Both are true looks.
        self._heard_at = time.monotonic()
        if look.reader == self._taken_from and look.at <= self._taken_at:
            # A heartbeat (the reader's last look again: it is alive, and has not
            # looked since, maybe because it cannot): no new numbers. Taken as a
            # look, each one was a spell with no starts, the rate decayed, and
            # within ~20 s every follower refused every class with a queue.
            return
        # Per reader: another reader's clock may be behind (a new reader's looks
        # are new whatever their times say against the old one's).
        self._taken_from, self._taken_at = look.reader, look.at
        self._on_look(look)

    async def _poked(self, msg: Msg) -> None:
        if self.leading:
            self._on_poke()

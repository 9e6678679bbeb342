"""Deadline-aware shedding: refuse at the door what cannot start before its
deadline, instead of queueing it to die.

A watch reads every class's consumers in one list (the plain one, its lanes
and its excess; ``streams/depth.py``; the gateway's queue-depth metrics read
the same numbers) and keeps the queue depth (``num_pending``: published, not
yet handed to a worker) and the fleet's start rate (deliveries per second,
smoothed; a stall, such as a failover, lowers it while it lasts and is
forgotten once starts resume). A new request's expected wait is depth / rate;
if that, plus the first-token delay and the time an answer of the class takes
once started (learnt from the answers this gateway relayed), is past its
deadline (with a margin), the gateway answers 429 with Retry-After instead of
accepting it: admitting a request that starts in time but cannot finish only
turns a 429 into a 504. Class priority is the workers' (interactive first), so
a batch queue behind interactive work sees its rate fall and sheds first.

In a fleet, one gateway looks for all (gateway/inference/depth_share.py): the
watch of every other takes the looks it publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.js.client import JetStreamContext
from nats.js.errors import APIError

from gateway.inference.depth_share import DepthShare
from streams.definitions import Topology
from streams.depth import ClassDepth, DepthLook, read_look
from streams.tasks import stop_task

# Too little evidence to refuse anyone: a short queue drains whatever the rate.
MIN_DEPTH = 2
RATE_HALF_LIFE_S = 2.0
# A standing queue without a start for this many starts' time (at the rate
# before) is a stall, not a slow class's gap (QueueWatch._after_quiet).
STALL_STARTS = 4.0
SAFETY = 0.8
ANSWER_WINDOW = 32  # recent answers per class whose median generation time counts
# With every queue empty and nothing in flight, the watch looks this seldom (and
# at once after a publish): the numbers only matter once there is a queue.
IDLE_EVERY_S = 5.0


@dataclass
class ClassLoad:
    depth: int = 0  # num_pending: published, not handed to a worker yet
    ack_pending: int = 0  # handed to a worker, not acknowledged yet (for metrics)
    # Deliveries per second while the queue was not empty (an idle spell says
    # nothing about capacity); None until such a spell was seen: never shed blind.
    rate: float | None = None
    delivered: int = 0
    at: float = 0.0
    # Published by this gateway since the last look (a burst lands between
    # looks; the next look's depth includes them).
    since: int = 0
    # How long a standing queue has seen no start, and the rate before that.
    quiet_s: float = 0.0
    rate_before: float | None = None

    def expected_wait(self) -> float | None:
        """Seconds a request published now waits before a worker takes it."""
        depth = self.depth + self.since
        if depth < MIN_DEPTH or self.rate is None:
            return None
        return depth / max(self.rate, 1e-3)


class QueueWatch:
    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        every_s: float = 0.5,
        idle_every_s: float = IDLE_EVERY_S,
    ) -> None:
        self._js = js
        self._topo = topology
        self._every = every_s
        self._idle_every = idle_every_s
        self._poke = asyncio.Event()  # a publish: an idle watch looks again now
        self._published_at = 0.0
        self.loads: dict[str, ClassLoad] = {c.value: ClassLoad() for c in topology.classes}
        self._answers: dict[str, deque[float]] = {}
        # From a worker's start to the first token (Final.ttft_ms): no queueing in it.
        self._first_tokens: dict[str, deque[float]] = {}
        self._task: asyncio.Task[None] | None = None
        self.share: DepthShare | None = None
        # Each look's source, "read" (this gateway listed the consumers) or
        # "heard" (the fleet's reader published it): for the metrics.
        self.on_look: Callable[[str], None] = lambda source: None

    def shared(self, share: DepthShare) -> None:
        """Look only while ``share`` elects this gateway; else take its looks."""
        self.share = share

    async def start(self) -> None:
        if self.share is not None:
            await self.share.start()
        self._task = asyncio.create_task(self._run(), name="queue-watch")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
        if self.share is not None:
            await self.share.stop()

    def take_look(self, look: DepthLook) -> None:
        """Another gateway's look (it is the fleet's reader)."""
        self.on_look("heard")
        for key, found in look.classes.items():
            self._take(key, found.pending, found.ack_pending, found.delivered)

    def poke(self) -> None:
        """A follower published after an idle spell: look now."""
        self._published_at = time.monotonic()
        self._poke.set()

    def idle(self) -> bool:
        return not any(load.depth or load.ack_pending for load in self.loads.values())

    async def _follow(self) -> None:
        """Until this gateway is elected: nudge the reader after a publish of
        ours that ends an idle spell (the reader's looks keep the numbers)."""
        share = self.share
        assert share is not None
        while not share.leading:
            self._poke.clear()
            led = asyncio.ensure_future(share.led.wait())
            poked = asyncio.ensure_future(self._poke.wait())
            try:
                await asyncio.wait((led, poked), return_when=asyncio.FIRST_COMPLETED)
            finally:
                led.cancel()
                poked.cancel()
            if self._poke.is_set():
                await share.poke(self.idle())

    async def _run(self) -> None:
        glance = False  # an idle look: the stream's count first
        while True:
            if self.share is not None and not self.share.leading:
                await self._follow()
                glance = False
                continue
            self._poke.clear()  # before looking: a publish during the look looks again
            if not (glance and await self._stream_empty()):
                with contextlib.suppress(nats.errors.Error, TimeoutError, APIError):
                    await self._poll()
            glance = False
            # A publish may not have landed when we looked: busy for a while after one.
            recent = time.monotonic() - self._published_at < 2 * self._every
            if recent or not self.idle():
                await asyncio.sleep(self._every)
                continue
            # Idle: each look lists every consumer (a few hundred lanes), so
            # look seldom (a glance at the stream first), and again at once
            # when this gateway publishes.
            try:
                async with asyncio.timeout(self._idle_every):
                    await self._poke.wait()
            except TimeoutError:
                # Nothing published here; another gateway may have. One
                # stream_info says whether anything is queued or in flight at all.
                glance = True
                continue
            # Woken by a publish (counted as it was let in, before it lands):
            # look a beat later, when the burst it began is in the queue.
            await asyncio.sleep(self._every)

    async def _stream_empty(self) -> bool:
        """The work queue holds no message (none waiting, none unacked): every
        class's numbers are zero as they stand. False when it cannot be read."""
        try:
            counts = [
                (await self._js.stream_info(name)).state.messages
                for name in self._topo.request_streams
            ]
        except (nats.errors.Error, TimeoutError, APIError):
            return False
        empty = not any(counts)
        if empty and self.share is not None:
            # Idle as the last look left it; the delivery counts stand.
            idle = {c: ClassDepth(delivered=x.delivered, found=True) for c, x in self.loads.items()}
            await self.share.publish(DepthLook(self.share.reader_id, idle, time.time()))
        return empty

    async def _poll(self) -> None:
        reader = self.share.reader_id if self.share is not None else ""
        look = await read_look(self._js, self._topo, reader)
        self.on_look("read")
        for cls, depth in look.classes.items():
            self._take(cls, depth.pending, depth.ack_pending, depth.delivered)
        if self.share is not None:
            await self.share.publish(look)

    def _take(self, key: str, depth: int, acking: int, delivered: int) -> None:
        """A look's numbers of one queue: a class's shared one, or a pool's of it
        (streams.depth.queue_key; a pool's load is made at its first look)."""
        load = self.loads.setdefault(key, ClassLoad())
        now = time.monotonic()
        dt = now - load.at
        if load.at and load.depth > 0 and dt > 0:  # busy since the last look
            started = max(0, delivered - load.delivered)
            sample = started / dt
            if load.rate is None:
                # Nothing started yet while a queue stood means no worker pulls
                # it yet (a deployment pool before its workers attach, a fleet
                # starting), not a capacity of 0: learnt from it, the rate
                # refused the first burst (429) until the queue drained.
                load.rate = sample or None
            else:
                prior = load.rate
                if not started:
                    if not load.quiet_s:
                        load.rate_before = prior
                    load.quiet_s += dt
                elif load.quiet_s:
                    prior = self._after_quiet(load, prior)
                keep = math.exp(-dt * math.log(2) / RATE_HALF_LIFE_S)
                load.rate = keep * prior + (1 - keep) * sample
        else:  # the queue was empty: whatever quiet there was is over
            load.quiet_s, load.rate_before = 0.0, None
        load.depth, load.delivered, load.at, load.since = depth, delivered, now, 0
        load.ack_pending = acking

    def answered(self, cls: str, generation_s: float) -> None:
        """An answer of ``cls`` took this long from its first token to its end."""
        self._answers.setdefault(cls, deque(maxlen=ANSWER_WINDOW)).append(generation_s)

    def answer_time(self, cls: str) -> float:
        window = self._answers.get(cls)
        return statistics.median(window) if window else 0.0

    def started_to_first_token(self, cls: str, seconds: float) -> None:
        """A worker's own first-token delay for ``cls``: from its start, after the queue."""
        self._first_tokens.setdefault(cls, deque(maxlen=ANSWER_WINDOW)).append(seconds)

    def first_token_time(self, cls: str, fallback_s: float) -> float:
        """The median first-token delay once a request has started. ``fallback_s``
        (the client-side delay, which includes the queue) only until a worker
        has said: added to the queue's expected wait, that counted the wait twice
        under a standing queue, and refused what the deadline allowed."""
        window = self._first_tokens.get(cls)
        return statistics.median(window) if window else fallback_s

    def published(self, cls: str) -> None:
        load = self.loads.get(cls)
        if load is not None:
            load.since += 1
        self._published_at = time.monotonic()
        self._poke.set()

    @staticmethod
    def _after_quiet(load: ClassLoad, rate: float) -> float:
        """Starts again after a quiet spell: the rate to go on from. A spell of
        STALL_STARTS starts' time at the rate before it was a stall (a
        failover, a restart): while it lasted the rate fell and shed, rightly,
        as nothing moved; now it goes on from the rate before, as a stall says
        nothing of what the fleet serves once it moves (averaged in, it refused
        for seconds after a failover what the fleet then served). A shorter
        spell is a slow class's gap between starts: ``rate`` as it is."""
        before, quiet_s = load.rate_before, load.quiet_s
        load.quiet_s, load.rate_before = 0.0, None
        if before is not None and quiet_s * before >= STALL_STARTS:
            return before
        return rate

    def inputs(self, cls: str, first_token_s: float, queue: str = "") -> dict[str, Any]:
        """What :meth:`verdict` weighs for ``cls`` now, for a refusal's log line:
        a refusal that a fleet then serves fast is traced to the input that was off."""
        load = self.loads.get(queue or cls) or ClassLoad()
        return {
            "depth": load.depth + load.since,
            "rate": round(load.rate, 2) if load.rate is not None else None,
            "quiet_s": round(load.quiet_s, 3),
            "wait_s": _rounded(load.expected_wait()),
            "first_token_s": _rounded(self.first_token_time(cls, first_token_s)),
            "answer_s": _rounded(self.answer_time(cls)),
        }

    def verdict(
        self, cls: str, seconds_left: float, first_token_s: float, queue: str = ""
    ) -> float | None:
        """None: admit. Otherwise the Retry-After (seconds) of a refusal.
        ``first_token_s``: the class's client-side first-token delay, used only
        until workers have reported their own (:meth:`first_token_time`).
        ``queue``: the queue the request goes to, when not the class's shared one
        (a deployment pool's: streams.depth.queue_key)."""
        load = self.loads.get(queue or cls)
        wait = load.expected_wait() if load is not None else None
        if wait is None:
            return None
        # The deadline covers the whole answer; a margin, as the rate is an average.
        done_s = wait + self.first_token_time(cls, first_token_s) + self.answer_time(cls)
        if done_s <= SAFETY * seconds_left:
            return None
        # Come back when the queue ahead has drained to what a deadline allows.
        return min(30.0, max(1.0, done_s - SAFETY * seconds_left))


def _rounded(seconds: float | None) -> float | None:
    return round(seconds, 3) if seconds is not None else None

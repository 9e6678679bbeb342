"""Prefix affinity on JetStream priority groups.

The gateway puts a request that carries a long shared prefix on one of the
class's lane subjects (``jetserve.req.<class>.lNN``, chosen by the prefix
hash); each lane has its own durable consumer with the ``prioritized`` policy.
Every worker keeps one pull request waiting on every lane while it has a free
slot, with a priority that says how much it owns the lane: the server hands a
message to the highest-priority waiting pull. So

- the lane's owner serves it while it has room (its engine keeps the prefix's
  KV blocks warm);
- a saturated owner makes no new pull, so the message spills over to the
  next worker in the lane's order once the owner's standing pull is used or
  expires (within ``poll_s``);
- a dead owner's pulls vanish with its connection (or expire within
  ``poll_s``), so the next in order takes over: nothing is lost, and a message
  it held unacked comes back after ``ack_wait``.

Ownership is rendezvous hashing with bounded load over the live members (a KV
bucket each worker refreshes; ``streams/rendezvous.py``): one worker joining
or leaving moves about 1/n of the lanes, so warm prefix caches stay where they
are, and no worker owns more than ``load_factor`` times its share. A worker
pulls only the lanes it ranks among the first ``depth`` (owner and backups):
a class of 256 lanes costs each of 64 workers ~16 standing pulls (depth 4), not 256.

Over-fetch: pulls stand on several lanes at once, so a worker can be handed
more messages than it has slots. It keeps such a message (``in_progress``)
and starts it at its next free slot, and makes no new pull meanwhile: a nak
would be a delivery spent, and under a burst a message bounced between full
workers could spend all of its ``max_deliver`` without ever failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from streams.balance import HOT_PRIORITY, RATE_TAU_S
from streams.consumer import idle_expiry, stop_interest
from streams.definitions import PRIORITY_GROUP, Topology
from streams.membership import SHARED, Membership
from streams.pools import pool_lane_consumer_name, pool_token
from streams.subjects import RequestClass
from streams.tasks import stop_task
from workers.inference.admission import Admission

log = logging.getLogger(__name__)

OWNER_BATCH = 4  # messages one pull may bring the lane's owner
# Lane pulls answer on this many reply inboxes per puller (lane % groups), each
# withdrawn alone: a membership change withdraws the pulls of the groups whose
# lanes moved, not every standing pull. An inbox per lane meant thousands of
# subscriptions per process while a starting fleet's members were few (every
# lane ranked), and their churn as members joined stalled the connections.
INBOX_GROUPS = 16


class StartRate:
    """Requests started per second, an exponentially decaying average: what a
    worker tells the members as its load (its tier, streams/balance.py)."""

    def __init__(self, tau_s: float = RATE_TAU_S) -> None:
        self._tau = tau_s
        self._rate = 0.0
        self._at = time.monotonic()

    def _decayed(self, now: float) -> float:
        return self._rate * math.exp(-(now - self._at) / self._tau)

    def tick(self) -> None:
        now = time.monotonic()
        self._rate, self._at = self._decayed(now) + 1.0 / self._tau, now

    def value(self) -> float:
        return self._decayed(time.monotonic())


class LanePuller:
    """Keeps a prioritized pull request waiting on every lane of one class while
    admission has room, and starts what arrives (or hands it straight back)."""

    def __init__(
        self,
        nc: Client,
        topology: Topology,
        cls: RequestClass,
        rank: int,
        admission: Admission,
        membership: Membership,
        start: Callable[[Msg], None],
        poll_s: float,
        count: Callable[[str], None] = lambda event: None,
        idle_poll_s: float | None = None,
        quiet: Callable[[], bool] = lambda: True,
        pool: str = SHARED,
    ) -> None:
        self._nc = nc
        self._topo = topology
        self._cls = cls
        # SHARED: the class's own lanes; a deployment: that pool's lanes.
        self._pool = pool
        self._token = pool_token(pool) if pool else ""
        self._rank = rank
        self._admission = admission
        self._members = membership
        self._start = start
        self._poll = poll_s
        self._count = count  # lane events: "pull", "held", "handed_back", "withdrawn"
        # Pulls answer on a reply inbox per group of lanes, so that the pulls of
        # a moved lane's group can be withdrawn (interest dropped), the rest standing.
        self._root = f"{nc.new_inbox()}.{cls.value}"
        lanes = self._lanes = topology.pool_lanes if pool else topology.lanes_of(cls)
        self._subs: dict[int, Subscription] = {}  # group -> its reply inbox's subscription
        self._gen = [0] * INBOX_GROUPS  # each group's inbox generation (one per withdrawal)
        # The priority each lane's standing pulls were made at (None: no pull stands).
        self._pulled_at: list[int | None] = [None] * lanes
        # When each lane needs its next pull (inf: a lane this worker does not rank).
        self._live_until = [0.0] * lanes
        self._current = [0] * lanes  # the newest pull per lane (reply token)
        self._left = [0] * lanes  # messages the newest pull may still bring
        # Idle cost (streams/consumer.py): a lane's pulls that keep coming back
        # empty while the worker is quiet get longer, up to idle_poll_s.
        self._idle_poll = idle_poll_s
        self._quiet = quiet
        self._empty = [0] * lanes  # pulls in a row that brought nothing
        self._brought = [True] * lanes  # the newest pull delivered something
        self._wake = asyncio.Event()
        # Lanes whose standing pulls carry a priority of before a membership change.
        self._to_withdraw: set[int] = set()
        self._changed = False  # a membership change not looked at yet
        membership.changed.append(self._reprioritize)
        self._held: set[asyncio.Task[None]] = set()  # over-fetched, waiting for a slot
        self._unheld = asyncio.Event()
        self._unheld.set()
        self.handed_back = 0  # over-fetched messages returned to the lane (shutdown only)

    async def run(self) -> None:
        """Pull until admission closes (or cancelled): a source of
        ``streams.consumer.PullConsumer``."""
        loop = asyncio.get_running_loop()
        while await self._admission.wait_room(self._rank):
            if self._changed:
                self._find_moved()
            if self.stale:
                await self._withdraw_pulls()
            if self._held:
                await self._unheld.wait()  # held messages take the next slots first
                continue
            self._wake.clear()  # before pulling: an answer meanwhile wakes us again
            now = loop.time()
            for lane, until in enumerate(self._live_until):
                if until <= now:
                    await self._pull(lane, now)
            nearest = min(self._live_until, default=math.inf)
            left = None if nearest == math.inf else max(nearest - loop.time(), 0.01)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):  # not wait_for: 3.11 drops cancels
                    await self._wake.wait()

    async def hand_back(self) -> None:
        """Pulls still waiting at the server may deliver until they expire: keep
        listening that long (admission is closed: what arrives goes back), then leave."""
        if not self._subs:
            return
        if self._held:  # admission is closed: each hands its message back
            await asyncio.wait(set(self._held))
        subs = list(self._subs.values())
        self._subs.clear()
        if not await self._drop(subs):  # some pulls stand: wait out their expiry
            loop = asyncio.get_running_loop()
            last = max((t for t in self._live_until if t != math.inf), default=0.0)
            await asyncio.sleep(max(0.0, last - loop.time()) + 0.1)
        if self._held:
            await asyncio.wait(set(self._held))
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _drop(self, subs: list[Subscription]) -> bool:
        """Withdraw the pulls waiting on these inboxes, all in one round trip (a
        membership change at start-up moves most lanes: a round trip each kept
        the loop from pulling for seconds, and heartbeats late made members
        expire, which moved more lanes). What the server sent before it saw the
        UNSUBs is queued here, and the callback takes each (a closed admission
        hands it back). False: the withdrawal failed."""
        if not subs:
            return True
        if not await stop_interest(self._nc, *subs):
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                for sub in subs:
                    await sub._pending_queue.join()  # nats-py has no public drain for this
        return True

    def pulled_at(self, lane: int) -> int | None:
        """The priority of ``lane``'s newest pull (None: none made, or withdrawn)."""
        return self._pulled_at[lane]

    @property
    def stale(self) -> bool:
        """Whether standing pulls may still carry the ranks of before a change."""
        return self._changed or bool(self._to_withdraw)

    def _lane_rank(self, lane: int) -> int | None:
        """This worker's rank on ``lane`` among the members that pull its class."""
        return self._members.priority(self._lanes, lane, self._pool, self._cls.value)

    def _priority(self, lane: int) -> int | None:
        """This worker's priority for ``lane`` now: None when it is not among the
        lane's owner and backups; else its tier first (a hot worker's lanes go
        to its backups, a cold backup goes first: streams/balance.py), then
        its rank. A tier change reaches a lane at its next pull (within
        ``poll_s`` on a busy lane): the rate it follows moves over a minute."""
        rank = self._lane_rank(lane)
        if rank is None:
            return None
        return self._members.pull_priority(rank, self._pool)

    def _reprioritize(self) -> None:
        """Ranks moved: marked here, looked at by the pull loop's next pass, so
        that a burst of changes (a fleet starting) costs one new lane order, not
        one per change (each is a rendezvous over every lane and member)."""
        self._changed = True
        self._wake.set()

    def _find_moved(self) -> None:
        """The lanes whose standing pulls were made at another priority than
        this worker has now are withdrawn and pulled again (an idle worker's
        pulls last far longer than ``poll_s``: until they expired, a lane this
        worker no longer owns still came here first). Only those: one member
        joining or leaving moves ~1/n of the lanes, and withdrawing every lane's
        pulls on every worker at once left lanes with no pull waiting for up to
        a second on a busy machine."""
        self._changed = False
        moved = {
            lane
            for lane, was in enumerate(self._pulled_at)
            if was is not None and self._priority(lane) != was
        }
        for lane, until in enumerate(self._live_until):
            if until == math.inf and self._lane_rank(lane) is not None:
                self._live_until[lane] = 0.0  # newly ranked: pull it
                self._empty[lane] = 0
        self._to_withdraw |= {lane % INBOX_GROUPS for lane in moved}

    async def _withdraw_pulls(self) -> None:
        """Move each group with a moved lane to a new reply inbox and drop
        interest in its old one: the server drops the pulls waiting on it. What
        it sent before is still handled. Its lanes are pulled again at their
        priorities now (a lane no longer ranked, not at all)."""
        groups, self._to_withdraw = self._to_withdraw, set()
        old: list[Subscription] = []
        for group in groups:
            sub = self._subs.pop(group, None)
            if sub is not None:
                old.append(sub)
            self._gen[group] += 1
            for lane in range(group, self._lanes, INBOX_GROUPS):
                if self._pulled_at[lane] is not None:
                    self._pulled_at[lane] = None
                    self._live_until[lane] = 0.0
                    self._empty[lane] = 0
        await self._drop(old)
        for sub in old:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._count("withdrawn")

    def _pull_done(self, lane: int) -> None:
        """The lane needs a new pull now (an older, overlapped pull answering
        costs at most one extra pull that expires)."""
        self._live_until[lane] = 0.0
        self._wake.set()

    async def _pull(self, lane: int, now: float) -> None:
        priority = self._priority(lane)
        if priority is None:  # not among this lane's owner and backups
            self._live_until[lane] = math.inf
            return
        inbox = await self._lane_inbox(lane)
        # The owner takes a burst on its lane (requests sharing a prefix often
        # come together), as many as it has slots for, unless it is hot; the
        # others take one.
        owner = self._lane_rank(lane) == 0
        batch = max(1, min(self._admission.free_slots(), OWNER_BATCH)) if owner else 1
        if priority >= HOT_PRIORITY:
            batch = 1
        self._left[lane] = batch
        self._empty[lane] = 0 if self._brought[lane] else self._empty[lane] + 1
        self._brought[lane] = False
        expiry = idle_expiry(self._poll, self._idle_poll, self._empty[lane], self._quiet)
        request = {
            "batch": batch,
            "expires": int(expiry * 1e9),
            "group": PRIORITY_GROUP,
            "priority": priority,
        }
        if self._pool:
            consumer = pool_lane_consumer_name(self._token, self._cls, lane)
        else:
            consumer = self._topo.lane_consumer_name(self._cls, lane)
        stream = self._topo.stream_of_lane(self._cls, lane)
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._current[lane] += 1
        self._pulled_at[lane] = priority
        reply = f"{inbox}.{self._current[lane]}"
        # Marked live before the publish: its answer can arrive (and mark the
        # lane done) before the publish returns. A little before the server's
        # own expiry, so a new pull overlaps the old.
        self._live_until[lane] = now + expiry * 0.9
        try:
            await self._nc.publish(subject, json.dumps(request).encode(), reply=reply)
            self._count("pull")
        except nats.errors.Error as exc:
            log.warning("lane pull failed: %s", exc)
            self._live_until[lane] = now + 0.2  # retry shortly, not in a hot loop

    async def _lane_inbox(self, lane: int) -> str:
        """The reply inbox of ``lane``'s pulls (``<root>.<group>.<generation>.<lane>``),
        its group's subscribed on the group's first pull."""
        group = lane % INBOX_GROUPS
        inbox = f"{self._root}.{group}.{self._gen[group]}"
        if group not in self._subs:
            self._subs[group] = await self._nc.subscribe(f"{inbox}.*.*", cb=self._on_msg)
        return f"{inbox}.{lane}"

    async def _on_msg(self, msg: Msg) -> None:
        if msg.headers and msg.headers.get("Status"):
            # The server's note on a pull (expired, consumer gone), sent to the
            # pull's own reply subject: only the newest pull's note matters.
            if msg.subject.startswith(self._root):
                lane_s, pull_s = msg.subject.rsplit(".", 2)[-2:]
                if int(pull_s) == self._current[int(lane_s)]:
                    self._pull_done(int(lane_s))
            return
        # A message arrives under its own subject (jetserve.req.<class>.lNN,
        # or a pool's jetserve.pool.<token>.<class>.lNN).
        if msg.subject.startswith(self._root):
            lane = int(msg.subject.rsplit(".", 2)[-2])
        else:
            lane = int(msg.subject.rsplit(".", 1)[-1].lstrip("l"))
        self._left[lane] -= 1
        self._brought[lane] = True
        if self._left[lane] <= 0:
            self._pull_done(lane)
        if self._admission.try_acquire(self._rank):
            self._start(msg)
            return
        # Several lanes answered at once and this worker is full now: keep the
        # message and start it at the next free slot (not a nak: see the top).
        self._count("held")
        task = asyncio.create_task(self._hold(msg))
        self._held.add(task)
        self._unheld.clear()
        task.add_done_callback(self._release_hold)

    def _release_hold(self, task: asyncio.Task[None]) -> None:
        self._held.discard(task)
        if not self._held:
            self._unheld.set()
            self._wake.set()

    async def _hold(self, msg: Msg) -> None:
        """Wait for a slot, telling the server the message is still ours (so it
        is not redelivered meanwhile), then start it; closed: hand it back."""
        beat = self._topo.limits.ack_wait_s / 3
        slot = asyncio.create_task(self._admission.acquire(self._rank))
        try:
            while not (await asyncio.wait({slot}, timeout=beat))[0]:
                with contextlib.suppress(nats.errors.Error):
                    await msg.in_progress()
        finally:
            if not slot.done():
                await stop_task(slot)  # cancelled while waiting: the server redelivers
        got = slot.result()
        if got:
            self._start(msg)
            return
        self.handed_back += 1
        self._count("handed_back")
        with contextlib.suppress(nats.errors.Error):
            await msg.nak()

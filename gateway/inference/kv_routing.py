"""KV-event-aware routing (``jetserve gateway --kv-index``): a request goes to
the replica whose engine holds the longest prefix of its routing text, through
a lane that replica owns; with the index cold, or no live replica holding any
of it, to its hash lane as before (docs/routing.md, "KV-event-aware routing").

The gateway hears the workers' deltas on ``jetserve.kvidx`` into its own
in-memory index (gateway/inference/kv_index.py) and follows the members bucket
read-only, so it computes the same lane ownership the workers do
(streams/rendezvous.py) and drops the replicas that leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from gateway.inference.kv_index import KvIndex
from streams.definitions import Topology
from streams.kv_index import KV_INDEX_SUBJECT, PrefixKey, decode_delta
from streams.membership import Membership, follow_members
from streams.rendezvous import assign
from streams.tasks import stop_task

log = logging.getLogger(__name__)

RETRY_S = 1.0  # looking for the members bucket again (no worker has made it yet)


class KvRouting:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        topology: Topology,
        count: Callable[[str], None] = lambda source: None,
        index: KvIndex | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._topo = topology
        self._count = count  # a routing decision: "index" or "hash"
        self.index = index or KvIndex()
        self.deltas = 0
        self._members: Membership | None = None
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # (lane count, class) -> (the members it was computed for, each member's own
        # lanes of the class: among the members that pull it), computed off the
        # request path (a thread), after each change of the members.
        self._owned: dict[tuple[int, str], tuple[tuple[str, ...], dict[str, list[int]]]] = {
            (topology.lanes_of(cls), cls.value): ((), {}) for cls in topology.lane_classes
        }
        self._stale = asyncio.Event()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(KV_INDEX_SUBJECT, cb=self._on_delta)
        self._tasks = [
            asyncio.create_task(self._follow(), name="kv-index-members"),
            asyncio.create_task(self._reorder(), name="kv-index-lanes"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            await stop_task(task)
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()

    async def _on_delta(self, msg: Msg) -> None:
        try:
            delta = decode_delta(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable kv index delta: %s", exc)
            return
        members = self._members
        if members is not None and delta.replica not in members.members:
            return  # not (or no longer) a member: nothing to route to
        self.index.apply(delta)
        self.deltas += 1
        if delta.refresh and members is not None:
            self.index.retain(members.members)  # and forget the silent ones

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                view = await follow_members(
                    self._js, self._topo.replicas, self._topo.lane_load_factor
                )
                if view is not None:
                    self._members = view
                    view.changed.append(self._members_changed)
                    self._members_changed()
                    await view.run()  # until stopped; a bus error looks again
            self._members = None
            await asyncio.sleep(RETRY_S)

    @property
    def members(self) -> int:
        """The live members this gateway routes among: those its lane ownership
        is computed for (0: none seen yet)."""
        if self._members is None:
            return 0
        computed = [len(ms) for ms, _ in self._owned.values()]
        return min(computed) if computed else len(self._members.members)

    def _members_changed(self) -> None:
        if self._members is not None:
            self.index.retain(self._members.members)
        self._stale.set()

    async def _reorder(self) -> None:
        """Lane ownership for the members as they stand, in a thread: assigning
        256 lanes among 64 members takes ~25 ms, which a request must not wait."""
        while True:
            await self._stale.wait()
            self._stale.clear()
            members = self._members
            if members is None:
                continue
            now = members.members
            for lanes, cls in list(self._owned):
                owned = await asyncio.to_thread(self._owned_lanes, now, lanes, cls, members)
                self._owned[(lanes, cls)] = (now, owned)

    @staticmethod
    def _owned_lanes(
        now: tuple[str, ...], lanes: int, cls: str, view: Membership
    ) -> dict[str, list[int]]:
        serving = dict(view.serving)
        pulling = [m for m in now if m not in serving or serving[m].serves(cls)]
        owned: dict[str, list[int]] = {}
        for lane, ranked in enumerate(assign(pulling, lanes, view.depth, view.load_factor).orders):
            if ranked:
                owned.setdefault(ranked[0], []).append(lane)
        return owned

    def prepare(self, lanes: int, cls: str = "interactive") -> None:
        """Compute the ownership of ``lanes`` lanes of ``cls`` now (tests; the first
        request of a lane count otherwise asks for it and is hashed meanwhile)."""
        if self._members is not None:
            now = self._members.members
            self._owned[(lanes, cls)] = (
                now,
                self._owned_lanes(now, lanes, cls, self._members),
            )

    def lane(
        self, lanes: int, keys: Sequence[PrefixKey], hash_lane: int, cls: str = "interactive"
    ) -> int:
        """The lane of class ``cls`` for a request with ``keys`` whose prefix hashes
        to ``hash_lane``."""
        lane = self._indexed_lane(lanes, keys, hash_lane, cls)
        self._count("hash" if lane is None else "index")
        return hash_lane if lane is None else lane

    def _indexed_lane(
        self, lanes: int, keys: Sequence[PrefixKey], hash_lane: int, cls: str
    ) -> int | None:
        members = self._members
        if members is None or not keys or not lanes:
            return None
        n, holders = self.index.longest([k.key for k in keys], members.members)
        if not n:
            return None
        entry = self._owned.get((lanes, cls))
        if entry is None or entry[0] != members.members:
            # Not computed for these members yet (_reorder is at it): hashed meanwhile.
            self._owned.setdefault((lanes, cls), ((), {}))
            self._stale.set()
            return None
        owned = entry[1]
        if any(hash_lane in owned.get(h, ()) for h in holders):
            return hash_lane  # its own lane's owner holds it: the same place
        # The least loaded holder that owns a lane (loads as the members heard them).
        for replica in sorted(holders, key=lambda r: (members.loads.get(r, 0.0), r)):
            mine = owned.get(replica)
            if mine:
                return mine[keys[n - 1].key % len(mine)]  # one lane per prefix
        return None

"""Who is serving: the live workers and the deployment pool each serves.

A KV bucket (``jetserve_workers``) holds one key per worker, its value the
deployment the worker serves (empty: none declared) and its load (requests
started per second, smoothed). Each worker puts its key
every ``every_s`` and follows the bucket with one watch; lane ownership is
computed from what it sees (streams/rendezvous.py): the shared lanes among all
members, a pool's lanes among the pool's members. Gateways follow the same
bucket read-only, to know which pools have live workers.

A member not heard from for ``4 * every_s`` is gone, and forgotten: its entry
expires in the bucket without a delete marker (a SIGKILLed worker never says
goodbye), so the heartbeat loop drops it. A worker that leaves cleanly deletes
its entry, which every watch shows at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from streams.rendezvous import DEFAULT_DEPTH, DEFAULT_LOAD_FACTOR, LaneOrder, assign
from streams.tasks import stop_task

log = logging.getLogger(__name__)

MEMBERS_BUCKET = "jetserve_workers"
MAX_PRIORITY = 9  # the server's lowest priority level
SHARED = ""  # the shared class subjects' pool: every member
# Bounded load at run time: an owner starting more than this times its pool's
# mean (plus a little, so an idle fleet's noise does not count) lets its lanes'
# backups go first until it is back under (workers/inference/affinity.py).
HOT_FACTOR = 1.25
HOT_SLACK = 0.5  # requests per second


class MemberInfo(msgspec.Struct, frozen=True, array_like=True):
    """A member's value in the bucket: ``["deployment", load, "engine"]``.
    New fields go at the end with a default: an older reader ignores them."""

    deployment: str = ""
    load: float = 0.0
    engine: str = ""  # the engine's name and version as it reports them ("" unknown)


_info_decoder = msgspec.json.Decoder(MemberInfo)


def member_info(value: bytes | None) -> MemberInfo:
    """A bucket value; a plain deployment name (older workers) too."""
    if not value:
        return MemberInfo()
    if value[:1] == b"[":
        with contextlib.suppress(msgspec.DecodeError):
            return _info_decoder.decode(value)
    return MemberInfo(value.decode(errors="replace"))


class Membership:
    """The live members, as one process sees them. ``worker_id`` set: this
    process is a member (it joins, refreshes and leaves); None: it only follows
    (a gateway)."""

    def __init__(
        self,
        js: JetStreamContext,
        worker_id: str | None,
        replicas: int,
        every_s: float = 1.0,
        depth: int = DEFAULT_DEPTH,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        deployment: str = "",
        load: Callable[[], float] = lambda: 0.0,
        engine: str = "",
    ):
        self._js = js
        self.worker_id = worker_id
        self.deployment = deployment
        self.engine = engine
        self._load = load  # this worker's requests started per second, smoothed
        self.loads: dict[str, float] = {}  # member -> its load as last heard
        self.engines: dict[str, str] = {}  # member -> its engine version as last heard
        self._replicas = replicas
        self._every = every_s
        self.depth = depth  # the workers that pull each lane: owner and backups
        self._load_factor = load_factor
        # (pool, lane count) -> the order, for the current members.
        self._orders: dict[tuple[str, int], LaneOrder] = {}
        self._kv: KeyValue | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._seen: dict[str, tuple[float, str]] = {}  # member -> (last heard, deployment)
        self.members: tuple[str, ...] = (worker_id,) if worker_id else ()
        self.pools: dict[str, tuple[str, ...]] = {}  # deployment -> its members
        if worker_id and deployment:
            self.pools[deployment] = (worker_id,)
        self.changed: list[Callable[[], None]] = []  # told when the members change

    async def start(self) -> None:
        """Join (a member) and read who is there before serving (so priorities start right)."""
        if self.worker_id is None:
            self._kv = await self._js.key_value(MEMBERS_BUCKET)  # BucketNotFoundError: none yet
        else:
            self._kv = await self._js.create_key_value(
                KeyValueConfig(
                    bucket=MEMBERS_BUCKET, history=1, ttl=self._every * 4, replicas=self._replicas
                )
            )
            # A bucket just created on a cluster has no leader for a moment: retry.
            for attempt in range(50):
                try:
                    await self._kv.put(self.worker_id, self._value())
                    break
                except (nats.errors.Error, TimeoutError):
                    if attempt == 49:
                        raise
                    await asyncio.sleep(0.2)
        self._watcher = await self._kv.watchall()
        async for entry in self._watcher:
            if entry is None:  # the end of the current values
                break
            self._note(entry)
        self._recompute()

    def _value(self) -> bytes:
        return msgspec.json.encode(MemberInfo(self.deployment, round(self._load(), 3), self.engine))

    def _note(self, entry: KeyValue.Entry) -> None:
        if entry.operation in (KV_DEL, KV_PURGE):
            self._seen.pop(entry.key, None)
            self.loads.pop(entry.key, None)
            self.engines.pop(entry.key, None)
        else:
            info = member_info(entry.value)
            self._seen[entry.key] = (time.monotonic(), info.deployment)
            self.loads[entry.key] = info.load
            self.engines[entry.key] = info.engine

    def _recompute(self) -> None:
        horizon = time.monotonic() - self._every * 4
        for gone in [k for k, (at, _) in self._seen.items() if at < horizon]:
            del self._seen[gone]
            self.loads.pop(gone, None)
            self.engines.pop(gone, None)
        seen = {k: dep for k, (_, dep) in self._seen.items()}
        if self.worker_id:
            seen[self.worker_id] = self.deployment
        new = tuple(sorted(seen))
        pools: dict[str, list[str]] = {}
        for member in new:
            if seen[member]:
                pools.setdefault(seen[member], []).append(member)
        new_pools = {dep: tuple(ms) for dep, ms in pools.items()}
        if new != self.members or new_pools != self.pools:
            log.info("members now: %d (%s)", len(new), ",".join(new[:8]))
            self.members = new
            self.pools = new_pools
            self._orders.clear()
            for tell in self.changed:
                tell()

    async def run(self) -> None:
        assert self._kv is not None
        assert self._watcher is not None
        follow = asyncio.create_task(self._follow(self._watcher))
        try:
            while True:
                await asyncio.sleep(self._every)
                if self.worker_id:
                    with contextlib.suppress(nats.errors.Error, TimeoutError):
                        await self._kv.put(self.worker_id, self._value())
                self._recompute()
        finally:
            with contextlib.suppress(nats.errors.Error):
                await stop_task(follow)
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._watcher.stop()  # type: ignore[no-untyped-call]

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is not None:
                was = self._seen.get(entry.key)
                self._note(entry)
                now = self._seen.get(entry.key)
                # A join, a leave or a changed deployment: at once; a refresh
                # only moves the member's last-heard time.
                if was is None or now is None or was[1] != now[1]:
                    self._recompute()

    async def leave(self) -> None:
        if self._kv is not None and self.worker_id:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._kv.delete(self.worker_id)

    def hot(self, pool: str = SHARED) -> bool:
        """Whether this worker starts well above its pool's mean: its lanes'
        backups then go before it (bounded load while the load lasts, not only
        in how many lanes it owns)."""
        members = self.members if pool == SHARED else self.pools.get(pool, ())
        if len(members) < 2 or self.worker_id is None:
            return False
        mine = self._load()
        mean = sum(self.loads.get(m, 0.0) for m in members if m != self.worker_id) + mine
        mean /= len(members)
        return mine > HOT_FACTOR * mean + HOT_SLACK

    def engine_versions(self, deployment: str) -> tuple[str, ...]:
        """The engine versions ``deployment``'s live workers report, sorted and
        distinct ("" for a worker whose engine does not say)."""
        return tuple(sorted({self.engines.get(m, "") for m in self.pools.get(deployment, ())}))

    def live(self, deployment: str) -> bool:
        """Whether ``deployment``'s pool has a live worker."""
        return bool(self.pools.get(deployment))

    def order(self, lanes: int, pool: str = SHARED) -> LaneOrder:
        """The owners and backups of ``lanes`` lanes of ``pool`` (SHARED: the
        class subjects' lanes, among every member), as the members stand."""
        order = self._orders.get((pool, lanes))
        if order is None:
            members = self.members if pool == SHARED else self.pools.get(pool, ())
            order = self._orders[(pool, lanes)] = assign(
                members, lanes, self.depth, self._load_factor
            )
        return order

    def priority(self, lanes: int, lane: int, pool: str = SHARED) -> int | None:
        """0 for the lane's owner, 1 for its first backup, and so on; None: this
        worker is not among the lane's ``depth`` (it does not pull it)."""
        assert self.worker_id is not None
        rank = self.order(lanes, pool).rank(self.worker_id, lane)
        return None if rank is None else min(rank, MAX_PRIORITY)


async def follow_members(js: JetStreamContext, replicas: int) -> Membership | None:
    """A read-only view of the members (a gateway's), or None while no worker
    has made the bucket yet."""
    view = Membership(js, None, replicas)
    try:
        await view.start()
    except BucketNotFoundError:
        return None
    return view

"""Who is serving: the live workers and the deployment pool each serves.

A KV bucket (``jetserve_workers``) holds one key per worker, its value the
deployment the worker serves (empty: none declared), its load (requests
started per second, smoothed), the model ids its engine serves and the LoRA
adapters it holds (each with its base model). A worker that holds adapters is a
member of one more pool per adapter (streams.pools.adapter_pool): requests for
an adapter go only there. Each worker puts its key
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

from streams.balance import BALANCE, BalanceRule
from streams.pools import adapter_pool
from streams.provision import ensure_bucket
from streams.rendezvous import DEFAULT_DEPTH, DEFAULT_LOAD_FACTOR, LaneOrder, assign
from streams.tasks import stop_task

log = logging.getLogger(__name__)

MEMBERS_BUCKET = "jetserve_workers"
MAX_PRIORITY = 9  # the server's lowest priority level
SHARED = ""  # the shared class subjects' pool: every member


class Adapter(msgspec.Struct, frozen=True, array_like=True):
    """A LoRA adapter a worker's engine serves: ``["name", "parent"]`` (the base model)."""

    name: str
    parent: str = ""


class MemberInfo(msgspec.Struct, frozen=True, array_like=True):
    """A member's value in the bucket:
    ``["deployment", load, [models], [adapters], "engine", [classes]]``.
    Fields are only ever added at the end: a reader takes the ones it knows."""

    deployment: str = ""
    load: float = 0.0
    # The engine's base model ids (its /v1/models less the adapters); empty: the
    # worker could not say (an older worker, an engine without /v1/models).
    models: tuple[str, ...] = ()
    adapters: tuple[Adapter, ...] = ()
    engine: str = ""  # the engine's build as it reports it, e.g. "vllm 0.11.0" ("" unknown)
    # The request classes it pulls; empty: every class (an older worker).
    classes: tuple[str, ...] = ()

    def serves(self, cls: str | None) -> bool:
        return cls is None or not self.classes or cls in self.classes

    def pools(self) -> tuple[str, ...]:
        """The pools this member pulls: its deployment's and one per adapter."""
        if not self.deployment:
            return ()
        return (self.deployment, *(adapter_pool(self.deployment, a.name) for a in self.adapters))

    def same_pools(self, other: MemberInfo) -> bool:
        return (self.deployment, self.models, self.adapters, self.classes) == (
            other.deployment,
            other.models,
            other.adapters,
            other.classes,
        )


_KNOWN = len(MemberInfo.__struct_fields__)


def member_info(value: bytes | None) -> MemberInfo:
    """A bucket value: a newer worker's (fields past the known ones are left
    out), an older one's, or a plain deployment name (the oldest workers)."""
    if not value:
        return MemberInfo()
    if value[:1] == b"[":
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            raw = msgspec.json.decode(value)
            if isinstance(raw, list):
                return msgspec.convert(raw[:_KNOWN], MemberInfo)
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
        models: tuple[str, ...] = (),
        adapters: tuple[Adapter, ...] = (),
        engine: str = "",
        classes: tuple[str, ...] = (),
    ):
        self._js = js
        self.worker_id = worker_id
        self.deployment = deployment
        self._mine = MemberInfo(deployment, 0.0, models, adapters, engine, classes)
        self._load = load  # this worker's requests started per second, smoothed
        self.loads: dict[str, float] = {}  # member -> its load as last heard
        self._replicas = replicas
        self._every = every_s
        self.depth = depth  # the workers that pull each lane: owner and backups
        self.load_factor = load_factor
        # (pool, lane count, class) -> the order, for the current members.
        self._orders: dict[tuple[str, int, str | None], LaneOrder] = {}
        self._kv: KeyValue | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        # member -> (last heard, what it serves; its load is in ``loads``)
        self._seen: dict[str, tuple[float, MemberInfo]] = {}
        self.members: tuple[str, ...] = (worker_id,) if worker_id else ()
        # pool (a deployment, or a deployment's adapter) -> its members
        self.pools: dict[str, tuple[str, ...]] = {}
        if worker_id:
            self.pools = {pool: (worker_id,) for pool in self._mine.pools()}
        self.serving: dict[str, MemberInfo] = {}  # member -> what it serves
        self.changed: list[Callable[[], None]] = []  # told when the members change

    async def start(self) -> None:
        """Join (a member) and read who is there before serving (so priorities start right)."""
        if self.worker_id is None:
            self._kv = await self._js.key_value(MEMBERS_BUCKET)  # BucketNotFoundError: none yet
        else:
            # Bound if it is there, whatever its settings: created by a worker of
            # another --replicas or nats-py (which sets allow_msg_ttl or not), a
            # create with ours was refused ("already in use with a different
            # configuration") and every new worker of the fleet crashed at start.
            self._kv = await ensure_bucket(
                self._js,
                KeyValueConfig(
                    bucket=MEMBERS_BUCKET, history=1, ttl=self._every * 4, replicas=self._replicas
                ),
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
        load = round(self._load(), 3)
        return msgspec.json.encode(msgspec.structs.replace(self._mine, load=load))

    def _note(self, entry: KeyValue.Entry) -> None:
        if entry.operation in (KV_DEL, KV_PURGE):
            self._seen.pop(entry.key, None)
            self.loads.pop(entry.key, None)
        else:
            info = member_info(entry.value)
            self._seen[entry.key] = (time.monotonic(), msgspec.structs.replace(info, load=0.0))
            self.loads[entry.key] = info.load

    def _recompute(self) -> None:
        horizon = time.monotonic() - self._every * 4
        for gone in [k for k, (at, _) in self._seen.items() if at < horizon]:
            del self._seen[gone]
            self.loads.pop(gone, None)
        seen = {k: info for k, (_, info) in self._seen.items()}
        if self.worker_id:
            seen[self.worker_id] = self._mine
        new = tuple(sorted(seen))
        pools: dict[str, list[str]] = {}
        for member in new:
            for pool in seen[member].pools():
                pools.setdefault(pool, []).append(member)
        new_pools = {pool: tuple(ms) for pool, ms in pools.items()}
        self.serving = seen
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
                # A join, a leave or a change of what it serves: at once; a
                # refresh only moves the member's last-heard time.
                if was is None or now is None or not was[1].same_pools(now[1]):
                    self._recompute()

    async def leave(self) -> None:
        if self._kv is not None and self.worker_id:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._kv.delete(self.worker_id)

    def mean_load(self, pool: str = SHARED) -> float | None:
        """The pool's mean start rate, this worker's own rate as it is now and
        the others' as last heard; None: no pool to balance against (alone)."""
        members = self.members if pool == SHARED else self.pools.get(pool, ())
        if len(members) < 2 or self.worker_id is None:
            return None
        others = sum(self.loads.get(m, 0.0) for m in members if m != self.worker_id)
        return (others + self._load()) / len(members)

    def pull_priority(self, rank: int, pool: str = SHARED, rule: BalanceRule = BALANCE) -> int:
        """The priority of this worker's pulls on a lane it ranks ``rank``-th
        (0: owns): its tier against the pool's mean first (streams/balance.py),
        then the rank. Alone: the rank, in the normal tier."""
        mean = self.mean_load(pool)
        if mean is None:
            return min(rule.priority(rank, 0.0, 0.0), MAX_PRIORITY)
        return min(rule.priority(rank, self._load(), mean), MAX_PRIORITY)

    @property
    def mine(self) -> MemberInfo:
        return self._mine

    def set_served(self, models: tuple[str, ...], adapters: tuple[Adapter, ...]) -> None:
        """The engine's models or adapters changed (a LoRA adapter loaded or
        unloaded at run time): said from the next beat, which every member and
        gateway sees (they derive the pools from it)."""
        self._mine = msgspec.structs.replace(self._mine, models=models, adapters=adapters)

    def set_engine(self, engine: str) -> None:
        """The engine's build changed (replaced behind its URL): said from the next beat."""
        self._mine = msgspec.structs.replace(self._mine, engine=engine)

    def engine_versions(self, deployment: str) -> tuple[str, ...]:
        """The engine builds ``deployment``'s live workers report, sorted and
        distinct ("" for a worker whose engine does not say)."""
        members = self.pools.get(deployment, ())
        return tuple(sorted({self.serving[m].engine for m in members if m in self.serving}))

    def live(self, pool: str) -> bool:
        """Whether ``pool`` (a deployment's, or its adapter's) has a live worker."""
        return bool(self.pools.get(pool))

    def order(self, lanes: int, pool: str = SHARED, cls: str | None = None) -> LaneOrder:
        """The owners and backups of ``lanes`` lanes of ``pool`` (SHARED: the
        class subjects' lanes, among every member) of class ``cls``, among the
        members that pull ``cls`` (None: every member), as they stand. Among every
        member, a class's lanes went to workers of other classes (deploy/ runs a
        Deployment per class), which never pull them: a request hashed there
        waited out its deadline."""
        order = self._orders.get((pool, lanes, cls))
        if order is None:
            members = self.members if pool == SHARED else self.pools.get(pool, ())
            serving = self.serving
            members = tuple(m for m in members if m not in serving or serving[m].serves(cls))
            order = self._orders[(pool, lanes, cls)] = assign(
                members, lanes, self.depth, self.load_factor
            )
        return order

    def priority(
        self, lanes: int, lane: int, pool: str = SHARED, cls: str | None = None
    ) -> int | None:
        """0 for the lane's owner, 1 for its first backup, and so on; None: this
        worker is not among the lane's ``depth`` (it does not pull it)."""
        assert self.worker_id is not None
        rank = self.order(lanes, pool, cls).rank(self.worker_id, lane)
        return None if rank is None else min(rank, MAX_PRIORITY)


async def follow_members(
    js: JetStreamContext, replicas: int, load_factor: float = DEFAULT_LOAD_FACTOR
) -> Membership | None:
    """A read-only view of the members (a gateway's), or None while no worker
    has made the bucket yet. ``load_factor``: the fleet's (its stream records it)."""
    view = Membership(js, None, replicas, load_factor=load_factor)
    try:
        await view.start()
    except BucketNotFoundError:
        return None
    return view

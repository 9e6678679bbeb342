"""The data plane's view of the route contracts: an immutable snapshot of the
``jetserve_routes`` KV bucket, kept current by a watch.

:meth:`RouteTable.start` loads every route before the gateway serves, then one
owned task follows the bucket's watch and swaps in a new snapshot (a fresh
dict) on every change. The request path only reads ``self._routes``: one
attribute load, no lock, and a request sees one consistent revision per route.

The table also keeps the records it has recently replaced, so a request that
started under revision N still finds N's fingerprints when it finishes after
N+1 arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict

import msgspec
import nats.errors
from nats.js.errors import NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from streams.routes import RouteRecord, decode_record
from streams.tasks import stop_task

log = logging.getLogger(__name__)


class RouteTable:
    def __init__(
        self, kv: KeyValue, *, keep: int = 256, retry_s: float = 1.0, load_s: float = 10.0
    ) -> None:
        self.kv = kv
        self._routes: dict[str, RouteRecord] = {}  # replaced, never mutated
        # (the snapshot it was built from, adapter -> the route listing it)
        self._adapters: tuple[dict[str, RouteRecord], dict[str, RouteRecord]] = ({}, {})
        self._recent: OrderedDict[tuple[str, int], RouteRecord] = OrderedDict()
        self._keep = keep
        self._retry_s = retry_s
        self._load_s = load_s  # how long a load may take to reach the bucket's last sequence
        self._kv_revision = 0  # the highest bucket revision applied to the snapshot
        self._changed = asyncio.Event()  # set and replaced on every swap
        self._task: asyncio.Task[None] | None = None

    # -- the request path ---------------------------------------------------------
    def get(self, name: str) -> RouteRecord | None:
        return self._routes.get(name)

    def names(self) -> list[str]:
        return sorted(self._routes)

    def for_adapter(self, adapter: str) -> RouteRecord | None:
        """The route that lists the LoRA ``adapter`` (the first by name if
        several do), or None."""
        routes = self._routes
        if self._adapters[0] is not routes:  # built once per swapped-in snapshot
            index: dict[str, RouteRecord] = {}
            for name in sorted(routes):
                for a in routes[name].contract.adapters:
                    index.setdefault(a, routes[name])
            self._adapters = (routes, index)
        return self._adapters[1].get(adapter)

    def at(self, name: str, revision: int) -> RouteRecord | None:
        """The record of ``name`` at ``revision``, if current or recently replaced."""
        current = self._routes.get(name)
        if current is not None and current.revision == revision:
            return current
        return self._recent.get((name, revision))

    def fingerprint(self, name: str, revision: int, deployment: str) -> str:
        record = self.at(name, revision)
        return record.fingerprints.get(deployment, "") if record is not None else ""

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Load every route (the gateway must not serve a routed model with the
        defaults for lack of a read), then follow changes in an owned task."""
        watcher = await self._load()
        self._task = asyncio.create_task(self._follow(watcher), name="route-table")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None

    async def wait_for(self, kv_revision: int, within_s: float) -> bool:
        """Until the snapshot includes bucket revision ``kv_revision`` (the admin
        API waits on it, so an apply is in force on this gateway when it returns)."""
        try:
            async with asyncio.timeout(within_s):
                while self._kv_revision < kv_revision:
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True

    # -- the watch ----------------------------------------------------------------
    async def _load(self) -> KeyValue.KeyWatcher:
        """A fresh watch and the full snapshot it starts with (last value per key).

        The watch's end-of-initial-values marker can come before the values
        (nats-py decides it from consumer info, whose reply can overtake the
        messages: see ``streams.kv_log``), so the snapshot is complete only when
        the bucket's last sequence, read from the stream before the watch
        began, is in it, marker or not."""
        state = (await self.kv.status()).stream_info.state
        want = state.last_seq if state.messages else 0
        watcher = await self.kv.watchall()
        routes: dict[str, RouteRecord] = {}
        top = 0
        marked = False
        try:
            async with asyncio.timeout(self._load_s):
                while not marked or top < want:
                    try:
                        entry = await asyncio.wait_for(anext(watcher), self._retry_s)
                    except TimeoutError:
                        if marked and not await self._stored(want):
                            break  # compacted away since: nothing more to wait for
                        continue
                    if entry is None:  # the end of the initial values
                        marked = True
                        continue
                    top = max(top, entry.revision or 0)
                    if entry.operation in (KV_DEL, KV_PURGE):
                        routes.pop(entry.key, None)
                        continue
                    record = self._decode(entry)
                    if record is not None:
                        routes[entry.key] = record
        except BaseException:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await watcher.stop()  # type: ignore[no-untyped-call]
            raise
        self._swap(routes, top)
        log.info("route table loaded: %d routes", len(routes))
        return watcher

    async def _stored(self, seq: int) -> bool:
        """Whether the bucket's stream still holds message ``seq`` (leader read)."""
        try:
            await self.kv._js.get_msg(self.kv._stream, seq=seq, direct=False)
        except NotFoundError:
            return False
        return True

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        while True:
            try:
                async for entry in watcher:
                    if entry is None:
                        continue
                    self._apply(entry)
                return  # the watcher was stopped
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("route watch failed (%s); reloading", exc)
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await watcher.stop()  # type: ignore[no-untyped-call]
            # Reload from scratch: deletes missed while the watch was down show too.
            while True:
                await asyncio.sleep(self._retry_s)
                try:
                    watcher = await self._load()
                    break
                except (nats.errors.Error, TimeoutError) as exc:
                    log.warning("route table reload failed: %s", exc)

    def _apply(self, entry: KeyValue.Entry) -> None:
        routes = dict(self._routes)
        if entry.operation in (KV_DEL, KV_PURGE):
            routes.pop(entry.key, None)
            log.info("route %s deleted", entry.key)
        else:
            record = self._decode(entry)
            if record is None:
                return  # keep serving the last good revision
            routes[entry.key] = record
            log.info("route %s now at revision %d", entry.key, record.revision)
        self._swap(routes, entry.revision or 0)

    def _swap(self, routes: dict[str, RouteRecord], kv_revision: int) -> None:
        for name, old in self._routes.items():
            if routes.get(name) is not old:
                self._recent[(name, old.revision)] = old
                while len(self._recent) > self._keep:
                    self._recent.popitem(last=False)
        self._routes = routes
        self._kv_revision = max(self._kv_revision, kv_revision)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    @staticmethod
    def _decode(entry: KeyValue.Entry) -> RouteRecord | None:
        try:
            record = decode_record(entry.value or b"")
        except msgspec.DecodeError as exc:  # ValidationError included
            log.error(
                "route %s (kv revision %s): undecodable record: %s", entry.key, entry.revision, exc
            )
            return None
        if record.contract.name != entry.key:
            log.error("route %s: record names route %r; ignored", entry.key, record.contract.name)
            return None
        return record

"""Leader reads of a KV bucket (streams/kv_log.py) and the route table's initial
load: neither may come back short for a key that has messages, however the
server's replies interleave and however slowly the reads go."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from gateway.admin.route_contracts import RouteStore, next_revision
from gateway.inference.route_table import RouteTable
from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.headers import Header
from streams.kv_log import KvLog
from streams.provision import ensure_routes
from streams.routes import RouteRecord, contract_from_builtins, encode, fingerprints

pytestmark = pytest.mark.connected


@contextlib.asynccontextmanager
async def bus(server: Service, role: Role = Role.GATEWAY) -> AsyncIterator[tuple[Client, KeyValue]]:
    """A connection with ``role``'s credential and the routes bucket bound."""
    nc = await connect(f"nats://127.0.0.1:{server.port}", f"t-{role.value}", server.bus_auth(role))
    try:
        yield nc, await ensure_routes(nc.jetstream())
    finally:
        await nc.close()


def record(name: str, revision: int) -> bytes:
    contract = contract_from_builtins(
        {
            "name": name,
            "candidates": [{"name": "dep-a", "adapter": "openai", "engine": "e", "model": name}],
            "deadline_s": float(revision),
        }
    )
    return encode(
        RouteRecord(
            contract=contract,
            revision=revision,
            updated_at=float(revision),
            updated_by="test",
            fingerprints=fingerprints(contract),
        )
    )


async def test_missing_deleted_and_live_keys_are_told_apart(nats_server: Service) -> None:
    async with bus(nats_server) as (_, kv):
        log = KvLog.of(kv)
        assert await log.keys() == []
        assert await log.last("never") is None
        assert await log.history("never") == []

        a1 = await kv.put("a", record("a", 1))
        a2 = await kv.put("a", record("a", 2))
        b1 = await kv.put("org/b.x", record("org/b.x", 1))
        await kv.delete("org/b.x", last=b1)

        assert await log.keys() == ["a", "org/b.x"]
        head = await log.last("a")
        assert head is not None
        assert (head.seq, head.deleted) == (a2, False)
        assert [m.seq for m in await log.history("a")] == [a1, a2]
        gone = await log.history("org/b.x")
        assert [m.deleted for m in gone] == [False, True]
        assert gone[0].seq == b1
        assert gone[1].at > 0
        assert await log.history("never") == []


async def test_history_is_whole_under_load(nats_server: Service) -> None:
    """Watch-based reads (nats-py's ``history()``) come back empty a few times
    in a hundred here; the leader reads must never."""
    async with bus(nats_server) as (_, kv), bus(nats_server, Role.ADMIN) as (_, load_kv):
        seqs = [await kv.put("k", record("k", r)) for r in (1, 2, 3)]
        log = KvLog.of(kv)
        stop = asyncio.Event()
        rounds = 0
        loaded = asyncio.Event()

        async def hammer() -> None:
            nonlocal rounds
            while not stop.is_set():
                await asyncio.gather(*(load_kv.put(f"load{j}", b"x" * 2048) for j in range(16)))
                rounds += 1
                loaded.set()

        async def watch_churn() -> None:  # ordered consumers created and dropped on the stream
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    await load_kv.history("k")

        tasks = [asyncio.create_task(hammer()) for _ in range(3)]
        tasks.append(asyncio.create_task(watch_churn()))
        try:
            await asyncio.wait_for(loaded.wait(), 10)
            for _ in range(150):
                assert [m.seq for m in await log.history("k")] == seqs
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert rounds > 0


async def test_history_is_whole_when_reads_are_slow_and_writes_race(
    nats_server: Service,
) -> None:
    async with bus(nats_server) as (_nc, kv):
        seqs = [await kv.put("k", record("k", r)) for r in range(1, 6)]
        log = KvLog.of(kv)
        js = log.js
        real_get = js.get_msg
        calls = 0
        raced: list[int] = []

        async def slow_get(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:  # the head is read: now write more while the rest is read
                raced.extend([await kv.put("k", record("k", r)) for r in (6, 7)])
            await asyncio.sleep(0.2)  # a slow server: no read may time out into "empty"
            return await real_get(*args, **kwargs)

        js.get_msg = slow_get  # type: ignore[method-assign]
        try:
            history = await log.history("k")
        finally:
            js.get_msg = real_get  # type: ignore[method-assign]
        # Everything up to the head the read began with, in order, nothing lost.
        assert [m.seq for m in history] == seqs
        assert len(raced) == 2
        assert [m.seq for m in await log.history("k")] == [*seqs, *raced]


class EarlyMarker:
    """A watcher whose end-of-initial-values marker overtakes the values: what
    nats-py does when consumer info's reply arrives before the messages."""

    def __init__(self, real: KeyValue.KeyWatcher) -> None:
        self.real = real
        self.marked = False

    def __aiter__(self) -> EarlyMarker:
        return self

    async def __anext__(self) -> KeyValue.Entry | None:
        if not self.marked:
            self.marked = True
            return None
        while True:
            entry: KeyValue.Entry | None = await self.real.__anext__()  # type: ignore[no-untyped-call]
            if entry is not None:  # the real marker: already given
                return entry

    async def stop(self) -> None:
        await self.real.stop()  # type: ignore[no-untyped-call]


async def test_route_table_loads_every_route_when_the_marker_comes_first(
    nats_server: Service,
) -> None:
    async with bus(nats_server) as (_, kv):
        await kv.put("r1", record("r1", 1))
        await kv.put("r1", record("r1", 2))
        gone = await kv.put("r2", record("r2", 1))
        await kv.delete("r2", last=gone)
        await kv.put("r3", record("r3", 1))

        real_watchall = kv.watchall

        async def early_watchall(**kwargs: Any) -> Any:
            return EarlyMarker(await real_watchall(**kwargs))

        kv.watchall = early_watchall  # type: ignore[method-assign]
        table = RouteTable(kv)
        await table.start()
        try:
            r1 = table.get("r1")
            assert r1 is not None
            assert r1.revision == 2
            assert table.get("r2") is None
            assert table.names() == ["r1", "r3"]
            # It then follows the watch as before.
            rev = await kv.put("r1", record("r1", 3))
            assert await table.wait_for(rev, 10)
            r1 = table.get("r1")
            assert r1 is not None
            assert r1.revision == 3
        finally:
            await table.stop()


async def testnext_revision_comes_from_the_newest_message(nats_server: Service) -> None:
    async with bus(nats_server) as (_, kv):
        store = RouteStore(kv)
        assert await next_revision(store, "r", await store.head("r")) == 1
        await kv.put("r", record("r", 1))
        last = await kv.put("r", record("r", 2))
        assert await next_revision(store, "r", await store.head("r")) == 3
        # The admin API's delete marker carries the revision it deleted...
        current = await store.current("r")
        assert current is not None
        await store.delete("r", current[0], last)
        head = await store.head("r")
        assert head is not None
        assert head.deleted
        assert head.headers[Header.ROUTE_REVISION] == "2"
        assert await next_revision(store, "r", head) == 3
        # ...and a bare marker (an older gateway's) numbers on from the history.
        again = await kv.put("o", record("o", 7))
        await kv.delete("o", last=again)
        assert await next_revision(store, "o", await store.head("o")) == 8

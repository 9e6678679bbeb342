"""A worker's notes of cancels (workers/inference/cancels.py) are bounded, and a
note let go is read back from the durable marks before its request starts."""

from __future__ import annotations

import asyncio

from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.inference.client import InferenceClient
from streams.marks import CancelMarks
from streams.provision import ensure_topology
from streams.wire import Cancel, encode
from tests.waits import until_true
from workers.inference.cancels import CancelWatch


async def test_notes_are_bounded_and_one_let_go_is_read_from_its_mark(
    nats_server: Service,
) -> None:
    """Every cancel of the fleet was kept an hour in every worker: hundreds a second
    grew each worker by hundreds of MB. Past ``max_notes`` the oldest are let go,
    and a request without a note is then looked up in the marks before it starts:
    a cancel is still never missed."""
    url = f"nats://127.0.0.1:{nats_server.port}"
    gw = await connect(url, "gw", nats_server.bus_auth(Role.GATEWAY))
    wk = await connect(url, "wk", nats_server.bus_auth(Role.WORKER))
    try:
        await ensure_topology(gw.jetstream(), DEFAULT_TOPOLOGY)
        client = InferenceClient(gw, gw.jetstream(), DEFAULT_TOPOLOGY)
        marks = CancelMarks(wk.jetstream(), DEFAULT_TOPOLOGY)
        watch = CancelWatch(wk, marks, keep_s=3600, max_notes=3)
        await watch.start()
        ids = [f"req{i}" for i in range(8)]
        for rid in ids:
            assert await client.cancel(rid, "client_disconnected")
        await until_true(lambda: "req7" in watch._notes, "the last cancel heard")
        assert len(watch._notes) == 3  # the bound, not the eight heard
        assert list(watch._notes) == ids[-3:]
        with watch.watch("req0", 1) as before:
            assert not before.is_set()  # let go: the in-memory check alone misses it
        await watch.check("req0")
        with watch.watch("req0", 1) as cancelled:
            assert cancelled.is_set()  # read back from its durable mark
        await watch.check("req-never-cancelled")
        with watch.watch("req-never-cancelled", 1) as other:
            assert not other.is_set()
        await watch.stop()
    finally:
        await wk.close()
        await gw.close()


async def test_after_a_reconnect_a_request_reads_its_own_mark_not_all_of_them(
    nats_server: Service,
) -> None:
    """After a reconnect every request's start waited for the full read of the
    marks (10 s for 300,000, nothing telling the server the message was still
    ours): ack_wait ran out, another worker got it, and the engine ran it twice.
    Now a request reads its own mark while the full read goes on."""
    url = f"nats://127.0.0.1:{nats_server.port}"
    gw = await connect(url, "gw", nats_server.bus_auth(Role.GATEWAY))
    wk = await connect(url, "wk", nats_server.bus_auth(Role.WORKER))
    watch = CancelWatch(wk, CancelMarks(wk.jetstream(), DEFAULT_TOPOLOGY), keep_s=3600)
    try:
        await ensure_topology(gw.jetstream(), DEFAULT_TOPOLOGY)
        await watch.start()
        async with watch._lock:  # a full read of the marks under way, and slow
            await wk.force_reconnect()
            await until_true(lambda: wk.stats["reconnects"] == 1, "the reconnect")
            # A cancel sent while it was away: its live publish missed, its mark kept.
            marks = CancelMarks(gw.jetstream(), DEFAULT_TOPOLOGY)
            assert await marks.mark("req-away", encode(Cancel("req-away", "client_disconnected")))
            await asyncio.wait_for(watch.check("req-away"), 10)  # not behind the read
            with watch.watch("req-away", 1) as cancelled:
                assert cancelled.is_set()
            await asyncio.wait_for(watch.check("req-other"), 10)
            with watch.watch("req-other", 1) as other:
                assert not other.is_set()
    finally:
        await watch.stop()
        await wk.close()
        await gw.close()

"""Provisioning, dedupe and the bounded work queue against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import PubAck, StreamConfig
from nats.js.client import JetStreamContext

from gateway.errors import RateLimited, StreamInterrupted
from gateway.inference.dispatch import Dispatcher, FrameStream
from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.definitions import Limits, Topology
from streams.errors import RequestTooLargeError
from streams.inference.frames import FrameBuffer
from streams.marks import CancelMarks
from streams.provision import ensure_stream, ensure_topology
from streams.routes import HedgePolicy
from streams.subjects import (
    RequestClass,
    cancel_subject,
    live_subject,
    reply_subject,
    request_subject,
)
from streams.wire import (
    HEDGE_ATTEMPT_BASE,
    Cancel,
    Final,
    InferenceRequest,
    Meta,
    Token,
    Usage,
    decode_cancel,
    encode,
)
from tests.waits import until

pytestmark = pytest.mark.connected


@contextlib.asynccontextmanager
async def on_bus(
    nats_server: Service, topo: Topology
) -> AsyncIterator[tuple[Client, JetStreamContext, Dispatcher]]:
    """A connection to the real server, ``topo`` provisioned, a gateway's dispatcher."""
    nc = await connect(f"nats://127.0.0.1:{nats_server.port}", "t", nats_server.bus_auth())
    try:
        js = nc.jetstream()
        await ensure_topology(js, topo)
        yield nc, js, Dispatcher(nc, js, "gw", topo)
    finally:
        await nc.close()


def request(i: int) -> tuple[InferenceRequest, Meta]:
    now = time.time()
    req = InferenceRequest(
        id=f"req-{i}",
        op="chat",
        cls="batch",
        model="m",
        body={},
        reply="jetserve.reply.t.gw.r",
        deadline=now + 9,
    )
    return req, Meta(op="chat", model="m", cls="batch", tenant="t", deadline=now + 9, created=now)


async def test_provisioning_is_idempotent_and_concurrent(nats_server: Service) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    conns = [await connect(url, f"p{i}", nats_server.bus_auth(Role.GATEWAY)) for i in range(3)]
    try:
        await asyncio.gather(*(ensure_topology(nc.jetstream()) for nc in conns))
        await ensure_topology(conns[0].jetstream())
        js = conns[0].jetstream()
        info = await js.stream_info("JETSERVE_REQ")
        assert info.config.subjects == [f"jetserve.req.{c.value}" for c in RequestClass] + [
            "jetserve.req.interactive.*",
            "jetserve.req.batch.*",
            "jetserve.req.embed.excess",  # the lane classes' wildcards hold theirs
            "jetserve.pool.>",  # deployment pools (streams/pools.py)
        ]
        # nats-server 2.15 caps a stream at 1000 consumers unless it names a limit.
        assert info.config.max_consumers == 8192
        for cls in RequestClass:
            ci = await js.consumer_info("JETSERVE_REQ", f"workers-{cls.value}")
            assert ci.config.filter_subject == f"jetserve.req.{cls.value}"
        # The excess of the classes a gateway gates by tenant, one consumer each.
        for gated in ("interactive", "batch", "embed"):
            ci = await js.consumer_info("JETSERVE_REQ", f"workers-{gated}-excess")
            assert ci.config.filter_subject == f"jetserve.req.{gated}.excess"
        # Lane consumers: one per lane, in the priority group (raw API fields).
        raw = await conns[0].request("$JS.API.CONSUMER.INFO.JETSERVE_REQ.workers-batch-l15", b"")
        config = json.loads(raw.data)["config"]
        assert config["filter_subject"] == "jetserve.req.batch.l15"
        assert config["priority_policy"] == "prioritized"
        assert config["priority_groups"] == ["jetserve"]
    finally:
        for nc in conns:
            await nc.close()


async def test_gateways_starting_together_with_other_partitions_agree(
    nats_server: Service,
) -> None:
    """Two gateways on a new bus, configured with 1 and 4 frames partitions, start
    at once. The one that lost the race to create the work-queue stream took its
    own configuration on: it rewrote the recorded partitions, then one of them made
    capture streams whose subjects overlapped the other's, and every later start
    failed. The stream's creator wins; both, and a third, provision its layout."""
    url = f"nats://127.0.0.1:{nats_server.port}"
    conns = [await connect(url, f"g{i}", nats_server.bus_auth(Role.GATEWAY)) for i in range(3)]
    try:
        one, four = Topology(frames_partitions=1), Topology(frames_partitions=4)
        got = await asyncio.gather(
            ensure_topology(conns[0].jetstream(), one),
            ensure_topology(conns[1].jetstream(), four),
        )
        assert got[0].frames_partitions == got[1].frames_partitions
        later = await ensure_topology(conns[2].jetstream(), Topology(frames_partitions=2))
        assert later.frames_partitions == got[0].frames_partitions
    finally:
        for nc in conns:
            await nc.close()


async def test_an_update_keeps_the_metadata_another_version_recorded(
    nats_server: Service,
) -> None:
    """An update writes a stream's metadata whole: a gateway of an older version (a
    rolling upgrade) stripped the keys a newer one had recorded. Keys it does not
    set are kept; those it sets are its own."""
    nc = await connect(f"nats://127.0.0.1:{nats_server.port}", "p", nats_server.bus_auth())
    try:
        js = nc.jetstream()
        newer = {"jetserve.lanes.batch": "16", "jetserve.from_a_newer_version": "yes"}
        await js.add_stream(name="META", subjects=["meta.>"], metadata=newer)
        older = StreamConfig(
            name="META", subjects=["meta.>"], metadata={"jetserve.lanes.batch": "8"}
        )
        await ensure_stream(js, older)
        kept = (await js.stream_info("META")).config.metadata or {}
        assert kept["jetserve.lanes.batch"] == "8"
        assert kept["jetserve.from_a_newer_version"] == "yes"
    finally:
        await nc.close()


async def test_msg_id_dedupes_and_full_queue_refuses(nats_server: Service) -> None:
    topo = Topology(stream="SMALL", limits=Limits(max_msgs=3), lanes=16)
    async with on_bus(nats_server, topo) as (_nc, js, d):
        first = await d.submit(*request(0))
        again = await d.submit(*request(0))  # a gateway retry with the same request id
        assert not first.duplicate
        assert again.duplicate
        await d.submit(*request(1))
        await d.submit(*request(2))
        with pytest.raises(RateLimited) as info:
            await d.submit(*request(3))
        assert info.value.code == "queue_full"
        assert info.value.headers()["Retry-After"] == "1"
        assert (await js.stream_info("SMALL")).state.messages == 3


async def test_a_request_over_the_bus_limit_is_too_large_not_a_bus_outage(
    nats_server: Service,
) -> None:
    """Published without its payload made first (an agent's model call), a request
    over the server's max_payload raised nats-py's MaxPayloadError, read as the bus
    being down (retryable): the executor retried it until the step timed out."""
    topo = Topology(stream="BIG", lanes=16)
    async with on_bus(nats_server, topo) as (nc, _js, d):
        req, _ = request(0)
        big = msgspec.structs.replace(req, body={"pad": "x" * nc.max_payload})
        with pytest.raises(RequestTooLargeError):
            await d.client.publish(request_subject("batch"), big)
        ack = await d.client.publish(request_subject("batch"), req)  # the bus is fine
        assert ack.seq == 1


async def test_token_frames_lost_in_transit_are_recovered_or_end_visibly(
    nats_server: Service,
) -> None:
    """Core NATS delivers at most once: a frame the gateway missed (a server died
    on the way) is read back from the replicated frames capture; one the capture
    lacks too ends the stream with an error, never a text with a hole."""
    nc = await connect(f"nats://127.0.0.1:{nats_server.port}", "t", nats_server.bus_auth())
    try:
        js = nc.jetstream()
        await ensure_topology(js, Topology(lanes=16))
        # Not started: no live subscription, so only the capture sees what we publish.
        d = Dispatcher(nc, js, "gw", Topology(lanes=16), gap_recovery_s=0.5)

        def make(rid: str) -> InferenceRequest:
            return InferenceRequest(
                id=rid, op="chat", cls="interactive", model="m", body={},
                reply=reply_subject("t", "gw", rid), deadline=time.time() + 9, tenant="t",
            )  # fmt: skip

        healed = make("healed")
        for seq in (1, 2, 3):
            await nc.publish(healed.reply, encode(Token(seq, f"w{seq} ", attempt=2)))
        await nc.flush()
        queue = FrameBuffer()  # what reached the gateway: token 2 was lost
        for frame in (Token(1, "w1 ", attempt=2), Token(3, "w3 ", attempt=2)):
            queue.put_nowait(frame)
        queue.put_nowait(Final(4, "stop", Usage(1, 3), attempt=2))
        stream = FrameStream(d, healed, queue, duplicate=False)
        got = [await stream.next_event(1.0)]
        got += stream.drain_tokens()
        while not isinstance(got[-1], Final):
            got.append(await stream.next_event(1.0))
        assert [e.text for e in got if isinstance(e, Token)] == ["w1 ", "w2 ", "w3 "]

        lost = make("lost")  # nothing captured: token 2 cannot be recovered
        queue = FrameBuffer()
        for frame in (Token(1, "w1 "), Token(3, "w3 ")):
            queue.put_nowait(frame)
        stream = FrameStream(d, lost, queue, duplicate=False)
        assert isinstance(await stream.next_event(1.0), Token)
        assert stream.drain_tokens() == []
        with pytest.raises(StreamInterrupted):
            await stream.next_event(1.0)
    finally:
        await nc.close()


async def test_a_client_gone_while_its_request_is_queued_cancels_it_at_once(
    nats_server: Service,
) -> None:
    """The stream stored the request (a worker may pull it) but its
    acknowledgement is late, as on a loaded disk with ``sync: always``: the
    client's hang-up cancels the request by id then, not when the ack comes."""
    topo = Topology(lanes=16)
    async with on_bus(nats_server, topo) as (nc, js, d):
        heard: list[bytes] = []
        req, meta = request(7)

        async def hear(msg: Msg) -> None:
            heard.append(msg.data)

        await nc.subscribe(cancel_subject(req.id), cb=hear)
        release = asyncio.Event()
        stored = asyncio.Event()
        publish = d.client.publish

        async def late_ack(*args: Any, **kwargs: Any) -> PubAck:
            ack = await publish(*args, **kwargs)  # stored now
            stored.set()
            await release.wait()  # acknowledged later
            return ack

        d.client.publish = late_ack  # type: ignore[method-assign]
        gone = asyncio.Event()
        submitting = asyncio.create_task(d.submit(req, meta, gone=gone))
        await stored.wait()
        gone.set()
        marks = await CancelMarks(js, topo).open()

        async def marked() -> bool:
            try:
                entry = await marks.get(req.id)
            except nats.js.errors.KeyNotFoundError:
                return False
            return entry.value is not None

        await until(marked, "the cancel mark, before the acknowledgement")
        assert not submitting.done()
        assert d.cancelled_while_queueing == 1
        release.set()
        stream = await submitting
        assert stream.req.id == req.id
        assert heard, "no cancel was published while the publish waited"
        # Without a hang-up nothing is cancelled.
        quiet = await d.submit(*request(8), gone=asyncio.Event())
        assert quiet.req.id == "req-8"
        assert d.cancelled_while_queueing == 1


def hedge_outcomes(d: Dispatcher) -> list[str]:
    """The hedge outcomes ``d`` counts (sent, won, lost, ...), in order."""
    outcomes: list[str] = []
    d.on_hedge = lambda cls, outcome: outcomes.append(outcome)
    return outcomes


def late_copy_acks(d: Dispatcher) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold back a hedge copy's acknowledgement (a loaded disk under ``sync:
    always``): ``stored`` is set once the copy is stored, the ack returns once
    ``release`` is set."""
    release, stored = asyncio.Event(), asyncio.Event()
    publish = d.client.publish

    async def late_ack_for_the_copy(*args: Any, **kwargs: Any) -> PubAck:
        ack = await publish(*args, **kwargs)
        if kwargs.get("msg_id", "").endswith(".hedge"):
            stored.set()
            await release.wait()
        return ack

    d.client.publish = late_ack_for_the_copy  # type: ignore[method-assign]
    return release, stored


@pytest.mark.parametrize("decided_by", ["copy_first_token", "original_finished", "client_left"])
async def test_a_hedge_copy_acknowledged_late_is_seen_through(
    nats_server: Service, decided_by: str
) -> None:
    """The copy's publish stored it, but its acknowledgement comes late (a
    loaded disk under ``sync: always``), and meanwhile the race was decided:
    the copy's own first token came first, the original finished, or the
    client left. The copy is neither cancelled mid-publish (it is stored:
    a worker would run it unseen) nor lost to the books: it is counted once,
    the books wait for it, and the loser is cancelled by its sequence."""
    topo = Topology(lanes=16)
    async with on_bus(nats_server, topo) as (nc, js, d):
        await d.start()
        outcomes = hedge_outcomes(d)
        req, meta = request(20)
        live = live_subject(d.reply_for(meta.tenant, req.id))
        cancels: list[Cancel] = []

        async def hear(msg: Msg) -> None:
            cancels.append(decode_cancel(msg.data))

        await nc.subscribe(cancel_subject(req.id), cb=hear)
        release, stored = late_copy_acks(d)
        policy = HedgePolicy(enabled=True, delay=0.01, max_extra_ratio=1.0)
        stream = await d.submit(req, meta, hedge=policy)
        await stored.wait()
        assert stream.queued is not None
        copy_attempt = HEDGE_ATTEMPT_BASE + 1
        if decided_by == "copy_first_token":
            await nc.publish(live, encode(Token(1, "w1 ", attempt=copy_attempt)))
            assert isinstance(await stream.next_event(1.0), Token)
            assert stream.attempt == copy_attempt
        elif decided_by == "original_finished":
            await nc.publish(live, encode(Token(1, "w1 ")))
            await nc.publish(live, encode(Final(2, "stop", Usage(3, 1))))
            assert isinstance(await stream.next_event(1.0), Token)
            assert isinstance(await stream.next_event(1.0), Final)
        else:
            await stream.cancel("client_disconnected")
        stream.close()  # what the gateway's finish does first
        assert stream.hedge_task is not None
        assert not stream.hedge_task.cancelling(), "a copy in flight was cancelled"
        settled = asyncio.ensure_future(stream.hedge_settled())  # what finish awaits next
        release.set()
        await settled
        # The books, written after that, say it was hedged: they waited for the ack.
        assert stream.hedge_queued is not None, "the books would not say it was hedged"
        copy_seq = stream.hedge_queued[1]
        loser, kept, cancelled = {
            "copy_first_token": (stream.queued[1], copy_seq, ["sent", "won"]),
            "original_finished": (copy_seq, stream.queued[1], ["sent", "lost"]),
            "client_left": (copy_seq, None, ["sent"]),
        }[decided_by]
        assert outcomes == cancelled
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.get_msg(topo.stream, loser)
        if kept is not None:
            assert (await js.get_msg(topo.stream, kept)).data
        else:  # both gone: the original by the client's cancel, the copy after its ack
            with pytest.raises(nats.js.errors.NotFoundError):
                await js.get_msg(topo.stream, stream.queued[1])

        async def heard() -> bool:
            return bool(cancels)

        await until(heard, "the cancel of the loser")
        keep = {"copy_first_token": copy_attempt, "original_finished": 1, "client_left": 0}
        assert cancels[-1].keep_attempt == keep[decided_by]
        await d.stop()


async def test_stopping_ends_hedge_timers_and_sees_a_copy_in_flight_through(
    nats_server: Service,
) -> None:
    """The dispatcher owns its hedge tasks: stopping cancels the timers of copies
    not yet sent, and waits for a copy whose publish has begun (stored, it must be
    cancelled by its sequence, not left to run unseen)."""
    topo = Topology(lanes=16)
    async with on_bus(nats_server, topo) as (_, js, d):
        await d.start()
        outcomes = hedge_outcomes(d)
        waiting_req, waiting_meta = request(30)
        waiting = await d.submit(
            waiting_req,
            waiting_meta,
            hedge=HedgePolicy(enabled=True, delay=30.0, max_extra_ratio=1.0),
        )
        release, stored = late_copy_acks(d)
        req, meta = request(31)
        sending = await d.submit(
            req, meta, hedge=HedgePolicy(enabled=True, delay=0.01, max_extra_ratio=1.0)
        )
        await stored.wait()
        await sending.cancel("client_disconnected")  # nobody will read the copy
        stopping = asyncio.ensure_future(d.stop())
        release.set()
        await stopping
        assert waiting.hedge_task is not None
        assert waiting.hedge_task.cancelled()  # its 30 s timer did not outlive the stop
        assert sending.hedge_task is not None
        assert sending.hedge_task.done()
        assert not sending.hedge_task.cancelled()
        assert sending.hedge_queued is not None
        assert outcomes == ["sent"]
        with pytest.raises(nats.js.errors.NotFoundError):  # the copy cancelled by its seq
            await js.get_msg(topo.stream, sending.hedge_queued[1])

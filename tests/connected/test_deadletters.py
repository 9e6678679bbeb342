"""Poison input goes to the dead-letter stream with its reason; consumers carry on;
requests past max_deliver are reported to their caller, not dropped."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from gateway.inference.deadletters import MaxDeliveriesWatch
from gateway.inference.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from jetserve.fleet import Fleet
from jetserve.services import Service
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY, Limits, Topology
from streams.headers import Header
from streams.provision import ensure_topology
from streams.subjects import RequestClass, live_subject, reply_subject
from streams.wire import ErrorFrame, Final, InferenceRequest, Meta, Usage, decode_request, encode

pytestmark = pytest.mark.connected


def request(topo_reply: str, rid: str) -> tuple[InferenceRequest, Meta]:
    now = time.time()
    req = InferenceRequest(
        id=rid,
        op="chat",
        cls="interactive",
        model="m",
        body={},
        reply=topo_reply,
        deadline=now + 30,
        tenant="acme",
        created=now,
    )
    meta = Meta(
        op="chat", model="m", cls="interactive", tenant="acme", deadline=now + 30, created=now
    )
    return req, meta


async def dlq_messages(js: JetStreamContext, stream: str) -> list[RawStreamMsg]:
    info = await js.stream_info(stream)
    return (
        [
            await js.get_msg(stream, seq)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)
        ]
        if info.state.messages
        else []
    )


async def test_poison_request_is_dead_lettered_and_the_worker_carries_on(fleet: Fleet) -> None:
    nc = await connect(fleet.nats_url, "poisoner", fleet.bus_auth())
    js = nc.jetstream()
    try:
        await js.publish("jetserve.req.interactive", b"\x00not a request", timeout=5)
        for _ in range(100):
            msgs = await dlq_messages(js, DEFAULT_TOPOLOGY.dlq_stream)
            if msgs:
                break
            await asyncio.sleep(0.05)
        assert msgs, "nothing was dead-lettered"
        poison = msgs[-1]
        assert poison.data == b"\x00not a request"
        headers = poison.headers or {}
        assert headers[Header.DLQ_REASON.value].startswith("undecodable request")
        assert headers[Header.DLQ_SOURCE.value] == "jetserve.req.interactive"
    finally:
        await nc.close()
    async with httpx.AsyncClient() as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={
                "model": "sim-8b",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
            },
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
    assert r.status_code == 200  # the consumer carried on


async def test_past_max_deliver_is_reported_and_dead_lettered(nats_server: Service) -> None:
    topo = Topology(
        stream="MD",
        frames_stream="MD_FRAMES",
        dlq_stream="MD_DLQ",
        classes=(RequestClass.INTERACTIVE,),
        limits=Limits(ack_wait_s=0.3, max_deliver=2),
        lanes=16,
    )
    nc = await connect(f"nats://127.0.0.1:{nats_server.port}", "t", nats_server.bus_auth())
    try:
        js = nc.jetstream()
        await ensure_topology(js, topo)
        dispatcher = Dispatcher(nc, js, "gw", topo)
        await dispatcher.start()
        watch = MaxDeliveriesWatch(nc, js, topo, GatewayMetrics())
        await watch.start()
        req, meta = request(reply_subject("acme", "gw", "r1"), "r1")
        stream = await dispatcher.submit(req, meta)
        # A worker that takes the message and dies before acking, twice.
        sub = await js.pull_subscribe_bind(topo.consumer_name("interactive"), topo.stream)
        for _ in range(2):
            (msg,) = await sub.fetch(1, timeout=5)
            await asyncio.sleep(0.4)  # ack_wait passes
        # The server notices max_deliver when it would deliver again: a worker asks.
        with pytest.raises(TimeoutError):
            await sub.fetch(1, timeout=1)
        event = await stream.next_event(heartbeat_timeout=5)
        assert isinstance(event, ErrorFrame)
        assert event.code == "max_deliveries_exceeded"
        assert event.status == 503
        dead = await dlq_messages(js, "MD_DLQ")
        assert len(dead) == 1
        assert dead[0].headers is not None
        assert "max_deliver reached" in dead[0].headers[Header.DLQ_REASON.value]
        assert decode_request(dead[0].data or b"") == req  # the request kept, not the error frame
        assert (await js.stream_info("MD")).state.messages == 0  # not left stuck
        assert msg is not None
        await watch.stop()
        await dispatcher.stop()
    finally:
        await nc.close()


async def test_malformed_frame_is_dead_lettered_and_the_stream_continues(
    nats_server: Service,
) -> None:
    topo = Topology(stream="MF", frames_stream="MF_FRAMES", dlq_stream="MF_DLQ", lanes=16)
    nc = await connect(f"nats://127.0.0.1:{nats_server.port}", "t", nats_server.bus_auth())
    try:
        js = nc.jetstream()
        await ensure_topology(js, topo)
        dispatcher = Dispatcher(nc, js, "gw", topo)
        await dispatcher.start()
        req, meta = request(reply_subject("acme", "gw", "r2"), "r2")
        stream = await dispatcher.submit(req, meta)
        # As a worker would: on the live twin of the reply subject.
        await nc.publish(live_subject(req.reply), b"{garbage")
        await nc.publish(live_subject(req.reply), encode(Final(1, "stop", Usage(1, 0))))
        event = await stream.next_event(heartbeat_timeout=5)
        assert isinstance(event, Final)
        await dispatcher.stop()  # waits for the dead-letter write it owns
        dead = await dlq_messages(js, "MF_DLQ")
        assert [d.data for d in dead] == [b"{garbage"]
    finally:
        await nc.close()

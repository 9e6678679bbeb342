"""The WebSocket bridge and the NATS-native ingress, against a real fleet."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
import pytest
import websockets
import websockets.exceptions

from jetserve.fleet import Fleet
from streams.auth import Role
from streams.subjects import INGRESS_CHAT, INGRESS_EMBEDDINGS
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = pytest.mark.connected

BODY = {
    "model": "sim-8b",
    "messages": [{"role": "user", "content": "hello bridge"}],
    "max_tokens": 20,
}


async def reference(fleet: Fleet) -> str:
    import httpx

    async with httpx.AsyncClient() as c:
        r = await c.post(f"{fleet.sim_url}/v1/chat/completions", json=BODY)
    return str(r.json()["choices"][0]["message"]["content"])


async def test_websocket_round_trip(fleet: Fleet) -> None:
    url = f"ws://127.0.0.1:{fleet.gateway_port}/v1/ws"
    async with websockets.connect(
        url, additional_headers={"Authorization": f"Bearer {fleet.api_key}"}
    ) as ws:
        await ws.send(
            msgspec.json.encode(
                {"type": "request", "id": "s1", "body": {**BODY, "stream": True}}
            ).decode()
        )
        await ws.send(msgspec.json.encode({"type": "request", "id": "n1", "body": BODY}).decode())
        text: list[str] = []
        full = None
        done = False
        while not (done and full is not None):
            msg = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 10))
            if msg["id"] == "s1" and msg["type"] == "chunk":
                for ch in msg["data"]["choices"]:
                    text.append(ch["delta"].get("content") or "")
            elif msg["id"] == "s1" and msg["type"] == "done":
                done = True
            elif msg["id"] == "n1" and msg["type"] == "response":
                full = msg["data"]["choices"][0]["message"]["content"]
            else:
                raise AssertionError(msg)
    ref = await reference(fleet)
    assert "".join(text) == ref
    assert full == ref


async def test_websocket_rejects_bad_key(fleet: Fleet) -> None:
    # Refused before the upgrade is accepted: an HTTP 401 with an OpenAI error body.
    url = f"ws://127.0.0.1:{fleet.gateway_port}/v1/ws"
    with pytest.raises(websockets.exceptions.InvalidStatus) as info:
        async with websockets.connect(url, additional_headers={"Authorization": "Bearer sk-wrong"}):
            pass
    assert info.value.response.status_code == 401
    assert msgspec.json.decode(info.value.response.body)["error"]["code"] == "invalid_api_key"


async def test_nats_ingress_request_reply_and_stream(fleet: Fleet) -> None:
    # A service credential: it receives on its tenant's inbox only (streams/auth.py).
    nc = await fleet.connect(Role.SERVICE, fleet.spec.tenant, "service")
    try:
        hdrs = {"Authorization": f"Bearer {fleet.api_key}"}
        reply = await nc.request(INGRESS_CHAT, msgspec.json.encode(BODY), timeout=10, headers=hdrs)
        assert reply.headers
        assert reply.headers["Jetserve-Status"] == "200"
        text = msgspec.json.decode(reply.data)["choices"][0]["message"]["content"]
        assert text == await reference(fleet)

        chunks: list[str] = []
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        stream_hdrs = {**hdrs, "Jetserve-Stream-To": inbox}
        done = await nc.request(
            INGRESS_CHAT,
            msgspec.json.encode({**BODY, "stream": True}),
            timeout=10,
            headers=stream_hdrs,
        )
        assert msgspec.json.decode(done.data)["done"] is True
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                break
            for ch in msgspec.json.decode(msg.data)["choices"]:
                chunks.append(ch["delta"].get("content") or "")
        assert "".join(chunks) == text

        bad = await nc.request(
            INGRESS_CHAT,
            msgspec.json.encode(BODY),
            timeout=10,
            headers={"Authorization": "Bearer nope"},
        )
        assert bad.headers
        assert bad.headers["Jetserve-Status"] == "401"
        assert msgspec.json.decode(bad.data)["error"]["code"] == "invalid_api_key"
    finally:
        await nc.close()


async def test_a_nats_stream_in_flight_at_shutdown_is_ended_recorded_and_told(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Past its grace, a stopping gateway drained its NATS connection under a
    # stream still in flight: the next publish failed, and the request ended with
    # no reply and no outcome (the orphan sweep recorded it minutes later). Now
    # the gateway ends it itself: cancelled upstream, recorded, the caller told.
    import httpx

    fleet = make_fleet(workers=1, gateway_args=["--grace", "1"])
    gw = fleet.gateway
    assert gw is not None
    nc = await fleet.connect(Role.SERVICE, fleet.spec.tenant, "service")
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.flush()
        hdrs = {
            "Authorization": f"Bearer {fleet.api_key}",
            "Jetserve-Stream-To": inbox,
            "X-Sim-Fault": "slow:100",  # 40 s of tokens: in flight when the grace ends
        }
        body = {**BODY, "stream": True, "max_tokens": 400, "ignore_eos": True}
        reply = asyncio.ensure_future(
            nc.request(INGRESS_CHAT, msgspec.json.encode(body), timeout=60, headers=hdrs)
        )
        await sub.next_msg(timeout=30)  # its first chunk: the stream is in flight
        gw.signal(signal.SIGTERM)
        answer = await reply
    finally:
        await nc.close()
    assert answer.headers
    assert answer.headers["Jetserve-Status"] == "503"
    assert msgspec.json.decode(answer.data)["error"]["code"] == "gateway_shutting_down"
    assert await asyncio.to_thread(gw.proc.wait, 30) == 0

    async def aborted() -> bool:  # the engine stopped generating it
        async with httpx.AsyncClient() as c:
            return int((await c.get(f"{fleet.sim_url}/sim/stats")).json()["aborted"]) == 1

    await until(aborted, "the engine's request aborted")
    fleet.start_gateway()  # to read the ledger: the stopped one recorded the request
    records: list[dict[str, Any]] = []

    async def recorded() -> bool:
        with fleet.admin() as admin:
            text = await asyncio.to_thread(admin.ledger, fleet.spec.tenant)
        records[:] = [msgspec.json.decode(line) for line in text.splitlines() if line]
        return bool(records)

    await until(recorded, "the request's record")
    assert [(r["outcome"], r["status"]) for r in records] == [("gateway_shutting_down", 503)]


async def test_a_tenants_requests_in_flight_over_nats_are_bounded(
    make_fleet: Callable[..., Fleet],
) -> None:
    # A service's connection is not a socket of the gateway's: the bound is the
    # tenant's requests in flight on a replica (the WebSocket's is per socket).
    fleet = make_fleet(workers=1, gateway_args=["--nats-max-inflight", "2"])
    nc = await fleet.connect(Role.SERVICE, fleet.spec.tenant, "service")
    try:
        hdrs = {"Authorization": f"Bearer {fleet.api_key}"}
        slow = {**hdrs, "X-Sim-Fault": "slow:100"}  # 4 s each: in flight together
        body = msgspec.json.encode({**BODY, "max_tokens": 40})

        async def ask(headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
            r = await nc.request(INGRESS_CHAT, body, timeout=30, headers=headers)
            assert r.headers
            return r.headers["Jetserve-Status"], msgspec.json.decode(r.data)

        answers = await asyncio.gather(*(ask(slow) for _ in range(3)))
        statuses = sorted(status for status, _ in answers)
        assert statuses == ["200", "200", "429"], answers
        (refused,) = [a for status, a in answers if status == "429"]
        assert refused["error"]["code"] == "too_many_inflight"
        status, _ = await ask(hdrs)  # the two ended: room again
        assert status == "200"
    finally:
        await nc.close()


def _books(fleet: Fleet) -> tuple[list[dict[str, Any]], int]:
    """The tenant's ledger records and its reserved (held) micro-dollars."""
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
        view = admin.get_limits("tenant", fleet.spec.tenant)
    return [msgspec.json.decode(x) for x in text.splitlines() if x], int(view["reserved_micros"])


def _request(rid: str, body: dict[str, Any]) -> str:
    return msgspec.json.encode({"type": "request", "id": rid, "body": body}).decode()


async def _round_trip(ws: Any) -> None:
    """Send a message the socket refuses and wait for the refusal: every message
    sent before it has been handled."""
    await ws.send("not json")
    while True:
        msg = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 30))
        if msg["type"] == "error" and msg["id"] == "":
            return


async def test_a_websocket_cancel_while_admitting_ends_the_request_once(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A cancel that arrives while the request is still being admitted (its hold
    waits on Redis, frozen here) lets the admission finish and then abandons the
    request: one `cancelled` record, the hold given back. Cancelling the task
    mid-admission, as before, left the hold taken until the sweep and the
    request unrecorded."""
    fleet = make_fleet(workers=1)
    assert fleet.redis is not None
    pid = fleet.redis.proc.pid
    url = f"ws://127.0.0.1:{fleet.gateway_port}/v1/ws"
    frozen = False
    try:
        async with websockets.connect(
            url, additional_headers={"Authorization": f"Bearer {fleet.api_key}"}
        ) as ws:
            await _round_trip(ws)  # authenticated and served once: the key is known
            os.kill(pid, signal.SIGSTOP)
            frozen = True
            await ws.send(_request("c1", {**BODY, "stream": True}))
            await _round_trip(ws)  # c1's admission has begun, and waits on Redis
            await ws.send(msgspec.json.encode({"type": "cancel", "id": "c1"}).decode())
            await _round_trip(ws)  # the cancel is handled, Redis still frozen
            os.kill(pid, signal.SIGCONT)
            frozen = False

            async def ended() -> bool:
                rows, reserved = await asyncio.to_thread(_books, fleet)
                return len(rows) == 1 and reserved == 0

            await until(ended, "the cancelled request's record and its hold given back")
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
    (row,) = (await asyncio.to_thread(_books, fleet))[0]
    assert row["outcome"] == "client_cancelled", row
    assert row["charge_micros"] == 0


async def test_a_websocket_dropped_mid_stream_ends_each_request_once(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The client's connection drops (no close handshake) with four streams in
    flight: each still ends in one recorded outcome, and no hold is left. (With
    three or more, the relays after the first failed send got starlette's
    RuntimeError for a closed socket, which ended them with no outcome: no
    record, the hold left to the orphan sweep, the engine stopped only by the
    frame buffer's overflow.)"""
    fleet = make_fleet(workers=1)
    url = f"ws://127.0.0.1:{fleet.gateway_port}/v1/ws"
    body = {**BODY, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    async with websockets.connect(
        url,
        additional_headers={"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:5"},
    ) as ws:
        for rid in "abcd":
            await ws.send(_request(rid, body))
        seen: set[str] = set()
        while seen != set("abcd"):
            msg = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 30))
            if msg["type"] == "chunk":
                seen.add(msg["id"])
        ws.transport.abort()  # the TCP connection drops

    async def ended() -> bool:
        rows, reserved = await asyncio.to_thread(_books, fleet)
        return len(rows) == 4 and reserved == 0

    await until(ended, "the requests' records and their holds given back")
    rows, _ = await asyncio.to_thread(_books, fleet)
    # Cancelled by the socket's close (or by a send that failed first).
    assert [r["outcome"] for r in rows] == ["client_cancelled"] * 4, rows


def _held_by_a_process(local_port: int, remote_port: int) -> bool:
    """Whether a process still holds the socket of this loopback connection's
    ``local_port`` end: /proc/net/tcp names its inode, 0 once no file refers to it
    (closed: what is left is the kernel's, still trying to deliver a FIN to a
    peer that does not read)."""
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            ports = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
            if ports == (local_port, remote_port):
                return fields[9] != "0"
    return False


def _ws_frame(text: bytes) -> bytes:
    """One masked text frame, as a client sends it."""
    mask = os.urandom(4)
    n = len(text)
    head = bytes([0x81]) + (
        bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n)
    )
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(text))


async def test_a_websocket_client_that_stops_reading_has_its_stream_ended_once(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A client sends a streamed request over a WebSocket, then never reads: the
    relay blocks in a send, the frame buffer overflows and the engine is stopped,
    but nothing read the overflow, so the request had no outcome (no record, its
    hold kept) for as long as the client held its socket open. Now it ends
    ``client_too_slow``, recorded once, its hold given back; and the socket, whose
    every send (the error frame, the idle close) waited on the client for ever, is
    dropped once a send has waited ``--ws-send-timeout``."""
    fleet = make_fleet(
        workers=1,
        gateway_args=[
            "--max-buffered-frames", "64", "--client-send-buffer", "16384",
            "--ws-send-timeout", "1", "--ws-idle-timeout", "1",
        ],
    )  # fmt: skip
    body = {
        "model": "sim-8b", "stream": True, "max_tokens": 6000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "far more than any buffer"}],
    }  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", fleet.gateway_port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        key = base64.b64encode(os.urandom(16))
        writer.write(
            b"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key + b"\r\n"
            b"Sec-WebSocket-Version: 13\r\nX-Sim-Fault: slow:3\r\n"
            b"Authorization: Bearer " + fleet.api_key.encode() + b"\r\n\r\n"
        )
        assert b" 101 " in await reader.readuntil(b"\r\n\r\n")
        request = {"type": "request", "id": "s", "body": body}
        writer.write(_ws_frame(msgspec.json.encode(request)))
        await writer.drain()  # and never read again

        async def recorded() -> bool:
            rows, reserved = await asyncio.to_thread(_books, fleet)
            return len(rows) == 1 and reserved == 0

        await until(recorded, "the stuck stream's one record and its hold given back")
        rows, _ = await asyncio.to_thread(_books, fleet)
        assert rows[0]["outcome"] == "client_too_slow", rows

        ends = (fleet.gateway_port, sock.getsockname()[1])

        async def dropped() -> bool:
            return not await asyncio.to_thread(_held_by_a_process, *ends)

        await until(dropped, "the gateway letting go of the socket")
    finally:
        writer.close()


async def test_idempotency_keys_over_a_websocket_are_per_request(fleet: Fleet) -> None:
    """An Idempotency-Key in the upgrade was every request's: the socket's second
    request, another body, got 422 idempotency_key_reused. It is refused at the
    upgrade now; each request message carries its own, and a retry under one
    replays its first answer."""
    url = f"ws://127.0.0.1:{fleet.gateway_port}/v1/ws"
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    with pytest.raises(websockets.exceptions.InvalidStatus) as info:
        async with websockets.connect(url, additional_headers={**auth, "Idempotency-Key": "k"}):
            pass
    assert info.value.response.status_code == 400
    async with websockets.connect(url, additional_headers=auth) as ws:

        async def answer(rid: str, key: str, text: str) -> dict[str, Any]:
            body = {**BODY, "messages": [{"role": "user", "content": text}]}
            request = {"type": "request", "id": rid, "body": body, "idempotency_key": key}
            await ws.send(msgspec.json.encode(request).decode())
            msg: dict[str, Any] = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 30))
            assert (msg["id"], msg["type"]) == (rid, "response"), msg
            return msg

        first = await answer("a", "key-one-0123456789", "first")
        other = await answer("b", "key-two-0123456789", "second")
        again = await answer("c", "key-one-0123456789", "first")
    assert first["data"]["id"] != other["data"]["id"]
    assert again["data"] == first["data"]  # replayed, not run again


async def test_an_answer_over_the_bus_limit_gets_an_error_reply_over_nats(fleet: Fleet) -> None:
    """Embeddings as floats are ~4x their packed frames: rendered for a NATS caller,
    400 vectors were over the bus's message size, the reply's publish failed in a
    task nobody read, and the caller waited out its timeout. It gets an error, and
    the ledger says so: the request was recorded ``ok`` and charged in full while
    its caller got the 400."""
    too_big_before = [r for r in (await asyncio.to_thread(_books, fleet))[0] if r["status"] == 400]
    nc = await fleet.connect(Role.SERVICE, fleet.spec.tenant, "service")
    try:
        hdrs = {"Authorization": f"Bearer {fleet.api_key}"}
        body = {"model": "sim-embed", "input": [f"text {i}" for i in range(400)]}
        reply = await nc.request(
            INGRESS_EMBEDDINGS, msgspec.json.encode(body), timeout=30, headers=hdrs
        )
        assert reply.headers is not None
        assert reply.headers["Jetserve-Status"] == "400"
        assert msgspec.json.decode(reply.data)["error"]["code"] == "response_too_large"

        async def recorded() -> list[dict[str, Any]]:
            rows = [r for r in (await asyncio.to_thread(_books, fleet))[0] if r["status"] == 400]
            return rows[len(too_big_before) :]

        await until(recorded, "the too-big answer's record")
        (row,) = await recorded()
        assert (row["outcome"], row["charge_micros"]) == ("response_too_large", 0), row
        packed = {**body, "encoding_format": "base64"}  # what the error advises
        reply = await nc.request(
            INGRESS_EMBEDDINGS, msgspec.json.encode(packed), timeout=30, headers=hdrs
        )
        assert reply.headers is not None
        assert reply.headers["Jetserve-Status"] == "200"
        assert len(msgspec.json.decode(reply.data)["data"]) == 400
    finally:
        await nc.close()


async def test_made_up_keys_while_redis_is_stuck_are_checked_a_bounded_few_at_once(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Each NATS request was a task from its arrival, before its key was checked: a
    flood of made-up keys while the key store was slow (a lookup waits up to the
    Redis timeout) grew the gateway by bandwidth x that wait. At most
    ``--nats-max-unauthenticated`` are checked at once; the rest wait in the
    subscription, and every caller is answered."""
    fleet = make_fleet(workers=1, gateway_args=["--nats-max-unauthenticated", "3"])
    assert fleet.redis is not None
    nc = await fleet.connect(Role.SERVICE, fleet.spec.tenant, "service")
    body = msgspec.json.encode(BODY)

    async def ask(i: int) -> str:
        hdrs = {"Authorization": f"Bearer sk-made-up-{i:04d}"}
        r = await nc.request(INGRESS_CHAT, body, timeout=120, headers=hdrs)
        assert r.headers is not None
        return r.headers["Jetserve-Status"]

    async def checking() -> float:
        async with httpx.AsyncClient(timeout=10) as c:
            text = (await c.get(fleet.gateway_metrics_urls[0])).text
        return metric_sum(text, "jetserve_gateway_nats_unauthenticated", ingress="inference")

    try:
        os.kill(fleet.redis.proc.pid, signal.SIGSTOP)
        try:
            asks = [asyncio.create_task(ask(i)) for i in range(30)]
            # The first lookups time out against the frozen store (a 503 each):
            # by then all 30 have reached the gateway, and 3 are being checked.
            await asyncio.wait(asks, return_when=asyncio.FIRST_COMPLETED)
            await until(lambda: _equals(checking(), 3.0), "3 keys being checked")
            assert sum(t.done() for t in asks) < 30
        finally:
            os.kill(fleet.redis.proc.pid, signal.SIGCONT)
        statuses = await asyncio.gather(*asks)
        assert set(statuses) <= {"401", "503"}, statuses
        assert "401" in statuses  # the keys checked once the store was back
        await until(lambda: _equals(checking(), 0.0), "no key being checked")
    finally:
        await nc.close()


async def _equals(value: Awaitable[float], want: float) -> bool:
    return await value == want

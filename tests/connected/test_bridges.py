"""The WebSocket bridge and the NATS-native ingress, against a real fleet."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import websockets

from jetserve.fleet import Fleet
from streams.auth import Role
from streams.subjects import INGRESS_CHAT

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

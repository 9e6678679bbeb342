"""Bodies that cost the gateway more than their bytes show are refused before any
work, in OpenAI's error shape: a batch of prompts times ``n`` (each choice is state
in the gateway: 1.6 M of them were built at once, 800 MB, the event loop stalled
for seconds), and JSON nested deeper than the decoder recurses (a 500 in plain
text over HTTP; over a WebSocket, the socket and its requests were dropped)."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
import websockets

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected

DEEP = b"[" * 5000 + b"]" * 5000


def refused_400(r: httpx.Response) -> dict[str, object]:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error: dict[str, object] = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


async def test_a_batch_times_n_past_the_bound_is_refused_before_any_hold(fleet: Fleet) -> None:
    body = {"model": "sim-8b", "prompt": ["a"] * 20_000, "n": 16, "max_tokens": 1}
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{fleet.base_url}/v1/completions", json=body, headers=auth)
        assert refused_400(r)["param"] == "n"
        small = {**body, "prompt": "a", "n": 4}
        r = await c.post(f"{fleet.base_url}/v1/completions", json=small, headers=auth)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4


async def test_json_nested_too_deeply_is_a_400_over_http_and_the_websocket(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {fleet.api_key}", "Content-Type": "application/json"}
    deep = b'{"model":"sim-8b","messages":[{"role":"user","content":' + DEEP + b"}]}"
    async with httpx.AsyncClient(timeout=30) as c:
        for path in ("/v1/chat/completions", "/v1/runs"):
            r = await c.post(f"{fleet.base_url}{path}", content=deep, headers=auth)
            assert "nested too deeply" in str(refused_400(r)["message"]), path
    url = f"ws://127.0.0.1:{fleet.gateway_port}/v1/ws"
    async with websockets.connect(url, additional_headers=auth) as ws:
        await ws.send('{"type":"request","id":"a","body":{"x":' + DEEP.decode() + "}}")
        error = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 30))
        assert error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error"
        # The socket goes on: a request after it is answered.
        body = {"model": "sim-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        await ws.send(msgspec.json.encode({"type": "request", "id": "b", "body": body}).decode())
        answer = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 30))
        assert (answer["id"], answer["type"]) == ("b", "response"), answer


async def test_an_embeddings_request_past_the_bound_is_refused_before_the_engine(
    fleet: Fleet,
) -> None:
    """20,000 short inputs (a 41 MB answer) were embedded in full, then refused as
    too large for the bus: the engine's work, for nothing. At most 2048 inputs."""
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=60) as c:
        before = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["embeddings"]
        body = {"model": "sim-embed", "input": ["a"] * 20_000}
        r = await c.post(f"{fleet.base_url}/v1/embeddings", json=body, headers=auth)
        assert refused_400(r)["param"] == "input"
        after = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["embeddings"]
        assert after == before
        fine = await c.post(
            f"{fleet.base_url}/v1/embeddings",
            json={"model": "sim-embed", "input": ["a"] * 8},
            headers=auth,
        )
    assert fine.status_code == 200, fine.text
    assert len(fine.json()["data"]) == 8


async def test_an_embeddings_packing_the_relay_cannot_carry_is_refused_not_corrupted(
    fleet: Fleet,
) -> None:
    """vLLM packs base64 vectors by ``embed_dtype`` and ``endianness``; the frames
    carry float32 little-endian as the engine packed them, so a float client got
    half-length or byte-swapped vectors, with no error. A 400 now, the engine
    untouched; the defaults are served."""
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    url = f"{fleet.base_url}/v1/embeddings"
    async with httpx.AsyncClient(timeout=60) as c:
        before = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["embeddings"]
        for odd in ({"embed_dtype": "float16"}, {"endianness": "big"}):
            body = {"model": "sim-embed", "input": "x", **odd}
            r = await c.post(url, json=body, headers=auth)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "unsupported_parameter"
        after = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["embeddings"]
        assert after == before
        body = {"model": "sim-embed", "input": "x", "embed_dtype": "float32"}
        assert (await c.post(url, json=body, headers=auth)).status_code == 200

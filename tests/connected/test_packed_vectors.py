"""Embedding vectors cross the bus packed (float32 bytes, streams/vectors.py):
what clients get is what the engine answers directly, in either encoding, and a
sender that does not read packed vectors (a gateway from before) gets floats."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet
from streams.connect import connect
from streams.subjects import live_subject, reply_subject
from streams.vectors import floats
from streams.wire import ErrorFrame, Final, InferenceRequest, decode_frame, encode

pytestmark = pytest.mark.connected

INPUTS = ["alpha", "beta gamma delta", "alpha"]


async def _embeddings(c: httpx.AsyncClient, url: str, encoding: str, **kw: Any) -> dict[str, Any]:
    r = await c.post(
        f"{url}/v1/embeddings",
        json={"model": "sim-embed", "input": INPUTS, "encoding_format": encoding},
        **kw,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_clients_get_the_engines_own_answer_in_either_encoding(fleet: Fleet) -> None:
    auth = {"headers": {"Authorization": f"Bearer {fleet.api_key}"}}
    async with httpx.AsyncClient(timeout=30) as c:
        for encoding in ("float", "base64"):
            direct = await _embeddings(c, fleet.sim_url, encoding)
            via = await _embeddings(c, fleet.base_url, encoding, **auth)
            # Equal as the engine printed them: floats to the last digit, base64 byte for byte.
            assert [d["embedding"] for d in via["data"]] == [d["embedding"] for d in direct["data"]]
            assert [d["index"] for d in via["data"]] == [0, 1, 2]
            assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


async def test_a_sender_that_does_not_read_packed_vectors_gets_floats(fleet: Fleet) -> None:
    """A request without ``packed_vectors`` (a gateway from before the field) gets
    the floats its decoder expects; with it, the bytes."""
    async with httpx.AsyncClient(timeout=30) as c:
        direct = await _embeddings(c, fleet.sim_url, "float")
    want = [d["embedding"] for d in direct["data"]]
    nc = await connect(fleet.nats_url, "old-gateway", fleet.bus_auth())
    try:
        for packed in (False, True):
            rid = uuid.uuid4().hex
            reply = reply_subject(fleet.spec.tenant, "oldgw", rid)
            sub = await nc.subscribe(live_subject(reply))
            now = time.time()
            req = InferenceRequest(
                id=rid,
                op="embedding",
                cls="embed",
                model="sim-embed",
                body={"model": "sim-embed", "input": INPUTS},
                reply=reply,
                deadline=now + 60,
                tenant=fleet.spec.tenant,
                created=now,
                packed_vectors=packed,
            )
            await nc.jetstream().publish("jetserve.req.embed", encode(req), timeout=10)
            while True:
                frame = decode_frame((await sub.next_msg(timeout=60)).data)
                assert not isinstance(frame, ErrorFrame), frame
                if isinstance(frame, Final):
                    break
            await sub.unsubscribe()
            vectors = frame.embeddings or []
            assert all(isinstance(v, bytes if packed else list) for v in vectors)
            assert [floats(v) for v in vectors] == want
    finally:
        await nc.close()

"""Errors an engine sends inside a stream it already answered 200 (vLLM when a
request fails after its headers; TGI for every error of a stream): each keeps its
status and message through the relay, and only what a retry can help is retried.
Before, vLLM's error event was read as a chunk without choices (then 502 "ended
without a finish reason", its message lost), and every TGI error event was a 502
that no retry followed, an overload included."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected

BODY = {"model": "sim-8b", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


async def served(fleet: Fleet, fault: str) -> tuple[httpx.Response, int]:
    """The client's answer to a request every engine call of which fails with
    ``fault``, and how many engine calls it took."""
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": fault}
    async with httpx.AsyncClient(timeout=120) as c:
        before = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["requests"]
        r = await c.post(f"{fleet.base_url}/v1/chat/completions", json=BODY, headers=headers)
        after = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["requests"]
    return r, after - before


@pytest.mark.parametrize("dialect", ["openai", "tgi"])
async def test_an_in_band_error_keeps_its_status_and_message(
    make_fleet: Callable[..., Fleet], dialect: str
) -> None:
    args = [] if dialect == "openai" else ["--engine-dialect", "tgi"]
    fleet = make_fleet(workers=1, worker_args=args)
    # The caller's own error: at once, with the engine's words, never retried.
    r, calls = await served(fleet, "inband:400")
    assert r.status_code == 400, r.text
    assert "engine error 400 (simulated, in-band)" in r.json()["error"]["message"]
    assert calls == 1
    # An overload (vLLM's 5xx, TGI's "overloaded"): retried before the first token,
    # then refused as the engine's unavailability, not as a broken stream.
    fault = "inband:503" if dialect == "openai" else "inband:429"
    r, calls = await served(fleet, fault)
    assert r.status_code in (429, 503), r.text
    assert r.json()["error"]["code"] != "stream_interrupted"
    assert calls > 1  # retried


async def test_a_stream_broken_before_its_first_token_is_tried_once_more(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The engine closes the stream after its 200 and before a token (an engine
    restarting while the request queued): nothing was emitted, so it is tried
    once more (it was a 502 at once); once only, so a request that breaks its
    engine each time does not take down engine after engine. Broken after a
    token, it is never retried (the client saw text)."""
    fleet = make_fleet(workers=1)
    r, calls = await served(fleet, "drop:0")
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "stream_interrupted"
    assert calls == 2
    # What the engine sent wrong (a malformed chunk) is not tried again: another
    # attempt would most likely send it again.
    r, calls = await served(fleet, "malformed:0")
    assert r.status_code == 502, r.text
    assert calls == 1
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "drop:3"}
    async with httpx.AsyncClient(timeout=120) as c:
        before = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["requests"]
        async with c.stream(
            "POST", f"{fleet.base_url}/v1/chat/completions",
            json={**BODY, "stream": True}, headers=headers,
        ) as s:  # fmt: skip
            text = (await s.aread()).decode()
        after = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["requests"]
    assert "stream_interrupted" in text
    assert after - before == 1

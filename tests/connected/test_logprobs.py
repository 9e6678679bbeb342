"""Token log-probabilities through the relay (issue 17): what the engine computes
reaches the client exactly as the engine gives it directly, for chat and the
legacy completions API, streamed and whole. The simulator's logprobs are
deterministic, so the engine's own answer to the same request is the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from gateway.inference.openai_types import merge_logprobs
from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected

CHAT = {
    "model": "sim-8b",
    "messages": [{"role": "user", "content": "log probabilities please"}],
    "max_tokens": 12,
    "logprobs": True,
    "top_logprobs": 3,
    "seed": 7,
}
COMPLETION = {"model": "sim-8b", "prompt": "log probabilities", "max_tokens": 12, "logprobs": 2}


def path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def stream_logprobs(lines: list[str]) -> tuple[str, dict[str, Any] | None, int]:
    """The text, the merged logprobs and how many content chunks lacked them."""
    text, parts, bare = "", [], 0
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in msgspec.json.decode(line[6:])["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            if piece:
                text += piece
                bare += choice["logprobs"] is None
            parts.append(choice["logprobs"])
    return text, merge_logprobs(parts), bare


Answer = tuple[str, dict[str, Any] | None, int]


async def answer(
    c: httpx.AsyncClient, base: str, body: dict[str, Any], auth: dict[str, str]
) -> Answer:
    if body.get("stream"):
        async with c.stream("POST", base + path(body), json=body, headers=auth) as r:
            assert r.status_code == 200, await r.aread()
            return stream_logprobs([line async for line in r.aiter_lines()])
    r = await c.post(base + path(body), json=body, headers=auth)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["logprobs"], 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("body", [CHAT, COMPLETION], ids=["chat", "completions"])
async def test_logprobs_arrive_as_the_engine_gives_them(
    fleet: Fleet, body: dict[str, Any], stream: bool
) -> None:
    req = {**body, "stream": stream}
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        direct_text, direct, _ = await answer(c, fleet.sim_url, req, {})
        text, relayed, bare = await answer(c, fleet.base_url, req, auth)
    assert direct is not None
    assert text == direct_text
    assert relayed == direct
    assert bare == 0  # every streamed delta with text carried its own logprobs
    entries = direct["content"] if "messages" in body else direct["top_logprobs"]
    assert len(entries) == 12
    if "messages" in body:
        assert all(len(e["top_logprobs"]) == 3 for e in entries)
    else:
        assert all(len(e) == 2 for e in entries)  # token -> logprob, per position


async def test_top_logprobs_without_logprobs_is_refused_before_any_work(fleet: Fleet) -> None:
    body = {**CHAT, "logprobs": False}
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base_url + path(body), json=body, headers=auth)
        too_many = await c.post(
            fleet.base_url + path(body), json={**CHAT, "top_logprobs": 21}, headers=auth
        )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "top_logprobs"
    assert too_many.status_code == 400


async def test_an_answer_chunk_over_the_bus_limit_ends_in_one_error_not_at_the_deadline(
    make_fleet: Callable[..., Fleet],
) -> None:
    """TGI with tools answers in one piece: the whole reply and its logprobs in one
    frame, here over NATS's 1 MB. The publish failed, the worker took it for the
    bus and left the request unacked: redelivered, run again on the engine every
    ack wait, and the client got 504 at its deadline. Now: one 400 at once."""
    fleet = make_fleet(workers=1, worker_args=["--engine-dialect", "tgi"])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "model": "sim-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": "auto",
        "logprobs": True,
        "top_logprobs": 5,
        "max_tokens": 6000,
    }
    headers = {
        "Authorization": f"Bearer {fleet.api_key}",
        "X-Sim-Script": msgspec.json.encode({"content": "ab " * 4000}).decode(),
        "X-Jetserve-Timeout": "300",
    }
    async with httpx.AsyncClient(timeout=300) as c:
        r = await c.post(f"{fleet.base_url}/v1/chat/completions", json=body, headers=headers)
        stats = (await c.get(f"{fleet.sim_url}/sim/stats")).json()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "response_too_large"
    assert stats["requests"] == 1  # run once, not once per redelivery

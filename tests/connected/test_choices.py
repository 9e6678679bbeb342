"""``n`` choices through the relay (issue 17): every choice's text, finish reason
and logprobs reach the client under its index, as the engine gives them
directly, streamed and whole; and the budget hold covers all n."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from gateway.inference.openai_types import merge_logprobs
from jetserve.fleet import Fleet
from tests.waits import until

pytestmark = pytest.mark.connected

CHAT = {
    "model": "sim-8b",
    "messages": [{"role": "user", "content": "three ways to say it"}],
    "max_tokens": 10,
    "n": 3,
    "logprobs": True,
    "top_logprobs": 1,
    "stop": ["zz"],
}
COMPLETION = {"model": "sim-8b", "prompt": "three ways", "max_tokens": 10, "n": 3, "logprobs": 1}

Choices = dict[int, tuple[str, str | None, dict[str, Any] | None]]


def url(base: str, body: dict[str, Any]) -> str:
    return base + ("/v1/chat/completions" if "messages" in body else "/v1/completions")


def from_stream(lines: list[str]) -> Choices:
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    parts: dict[int, list[dict[str, Any] | None]] = {}
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in msgspec.json.decode(line[6:])["choices"]:
            i = c["index"]
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            text[i] = text.get(i, "") + (piece or "")
            finish[i] = c["finish_reason"] or finish.get(i)
            parts.setdefault(i, []).append(c["logprobs"])
    return {i: (text[i], finish[i], merge_logprobs(parts[i])) for i in text}


def from_body(body: dict[str, Any]) -> Choices:
    out: Choices = {}
    for c in body["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        out[c["index"]] = (text, c["finish_reason"], c["logprobs"])
    return out


async def choices(
    c: httpx.AsyncClient, base: str, body: dict[str, Any], auth: dict[str, str]
) -> Choices:
    if body.get("stream"):
        async with c.stream("POST", url(base, body), json=body, headers=auth) as r:
            assert r.status_code == 200, await r.aread()
            return from_stream([line async for line in r.aiter_lines()])
    r = await c.post(url(base, body), json=body, headers=auth)
    assert r.status_code == 200, r.text
    return from_body(r.json())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("body", [CHAT, COMPLETION], ids=["chat", "completions"])
async def test_every_choice_arrives_under_its_index(
    fleet: Fleet, body: dict[str, Any], stream: bool
) -> None:
    req = {**body, "stream": stream}
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        direct = await choices(c, fleet.sim_url, req, {})
        relayed = await choices(c, fleet.base_url, req, auth)
    assert sorted(direct) == [0, 1, 2]
    assert len({text for text, _, _ in direct.values()}) == 3  # three different choices
    assert relayed == direct


async def reserved(fleet: Fleet) -> int:
    with fleet.admin() as admin:
        view = await asyncio.to_thread(admin.get_limits, "tenant", fleet.spec.tenant)
    return int(view["reserved_micros"])


async def test_the_hold_covers_every_choice(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=1)
    auth = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "stall"}
    held: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=30) as c:
        for n in (1, 2, 4):
            body = {**CHAT, "n": n, "max_tokens": 100, "stream": True}
            async with c.stream("POST", url(fleet.base_url, body), json=body, headers=auth) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()  # not closed until we leave: the stream stays open
                while not (await anext(lines)).startswith("data: "):
                    pass  # running once a chunk came: its hold is in place
                held[n] = await reserved(fleet)
            # Hung up: the request is cancelled and its hold settled.
            await until(lambda: _zero(fleet), f"the n={n} hold released")
    # The hold is the prompt's worst case plus n x max_tokens of output.
    assert held[1] < held[2] < held[4]
    assert held[4] - held[1] == 3 * (held[2] - held[1])


async def _zero(fleet: Fleet) -> bool:
    return await reserved(fleet) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_echo_and_best_of_arrive_as_the_engine_gives_them(fleet: Fleet, stream: bool) -> None:
    # echo: the engine's echoed prompt is text like any other; best_of: the engine
    # generates best_of sequences and answers n, carried by index.
    body = {**COMPLETION, "echo": True, "best_of": 3, "n": 2, "stream": stream}
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        direct = await choices(c, fleet.sim_url, body, {})
        relayed = await choices(c, fleet.base_url, body, auth)
    assert sorted(direct) == [0, 1]
    assert all(text.startswith(str(COMPLETION["prompt"])) for text, _, _ in direct.values())
    assert relayed == direct


async def test_what_the_engine_refuses_comes_back_in_its_words(fleet: Fleet) -> None:
    # suffix goes to the engine, which decides: the simulator refuses it as vLLM does.
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    body = {**COMPLETION, "suffix": " the end"}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(url(fleet.base_url, body), json=body, headers=auth)
        early = await c.post(url(fleet.base_url, body), json={**body, "best_of": 2}, headers=auth)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "suffix is not currently supported"
    assert early.status_code == 400  # best_of below n: refused before any work
    assert early.json()["error"]["param"] == "best_of"

"""A reasoning model's thinking (vLLM's ``reasoning_content``) reaches the client
as the engine sends it, streamed and whole. The relay dropped it: a client never
saw it, and a reply whose budget went on thinking came back empty."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected

SCRIPT = {"reasoning": "First, the question asks for six times seven.", "content": "It is 42."}
BODY = {"model": "sim-8b", "messages": [{"role": "user", "content": "6 x 7?"}], "max_tokens": 64}


def streamed(lines: list[str]) -> tuple[str, str, str | None]:
    """The thinking, the answer and the finish reason of a streamed reply."""
    thought = text = ""
    finish = None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in msgspec.json.decode(line[6:])["choices"]:
            thought += choice["delta"].get("reasoning_content") or ""
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return thought, text, finish


async def both(
    c: httpx.AsyncClient, base: str, body: dict[str, Any], headers: dict[str, str]
) -> Any:
    whole = (await c.post(f"{base}/v1/chat/completions", json=body, headers=headers)).json()
    stream = {**body, "stream": True}
    async with c.stream("POST", f"{base}/v1/chat/completions", json=stream, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines()]
    choice = whole["choices"][0]
    message = choice["message"]
    return (
        message.get("reasoning_content"),
        message["content"],
        choice["finish_reason"],
    ), streamed(lines)


@pytest.mark.parametrize("max_tokens", [64, 5])
async def test_reasoning_is_relayed_as_the_engine_sends_it(fleet: Fleet, max_tokens: int) -> None:
    body = {**BODY, "max_tokens": max_tokens}
    script = {"X-Sim-Script": msgspec.json.encode(SCRIPT).decode()}
    auth = {"Authorization": f"Bearer {fleet.api_key}", **script}
    async with httpx.AsyncClient(timeout=60) as c:
        direct = await both(c, fleet.sim_url, body, script)
        through = await both(c, fleet.base_url, body, auth)
    assert through == direct
    (thought, text, finish), _ = through
    if max_tokens == 64:
        assert (thought, text, finish) == (SCRIPT["reasoning"], SCRIPT["content"], "stop")
    else:  # the budget went on thinking: the thinking is the whole reply
        assert thought
        assert SCRIPT["reasoning"].startswith(thought)
        assert (text, finish) == ("", "length")


async def test_a_resume_and_a_retried_key_replay_the_thinking_too(fleet: Fleet) -> None:
    """Replays come from the frames capture, whose batches kept a token's text
    and extras but not its thinking: a resume from the start and an
    Idempotency-Key retry came back without it."""
    script = {"X-Sim-Script": msgspec.json.encode(SCRIPT).decode()}
    auth = {"Authorization": f"Bearer {fleet.api_key}", **script}
    body = {**BODY, "stream": True}
    url = f"{fleet.base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as c:
        keyed = {**auth, "Idempotency-Key": "think-once-0123456789"}
        async with c.stream("POST", url, json=body, headers=keyed) as r:
            request_id = r.headers["x-request-id"]
            live = streamed([line async for line in r.aiter_lines()])
        async with c.stream(
            "GET", f"{fleet.base_url}/v1/requests/{request_id}/stream",
            headers={**auth, "Last-Event-ID": "0"},
        ) as r:  # fmt: skip
            resumed = streamed([line async for line in r.aiter_lines()])
        async with c.stream("POST", url, json=body, headers=keyed) as r:
            retried = streamed([line async for line in r.aiter_lines()])
    assert live[0] == SCRIPT["reasoning"]
    assert resumed == live
    assert retried == live

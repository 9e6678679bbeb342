"""The non-streaming request of `jetserve bench capacity --no-stream`: one whole
response, timed from sending to its body read; the streaming one is ``client.stream_one``."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec

from jetserve.bench.client import Clock, _error_text, classify
from jetserve.bench.timeline import Outcome, Timeline


class _Message(msgspec.Struct):
    content: str | None = None


class _FullChoice(msgspec.Struct):
    message: _Message | None = None
    text: str | None = None  # /v1/completions


class _FullUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Full(msgspec.Struct):
    choices: list[_FullChoice] | None = None
    usage: _FullUsage | None = None


_decode_full = msgspec.json.Decoder(_Full).decode


async def complete_one(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    body: bytes,
    *,
    index: int,
    t0: float,
    deadline: float,
    clock: Clock = time.perf_counter,
) -> Timeline:
    """One non-streaming request: e2e is from sending to the whole body read."""
    sent = clock()
    status, error = 0, ""
    outcome: Outcome = "error"
    usage: _FullUsage | None = None
    try:
        async with asyncio.timeout(max(deadline - sent, 0.0)):
            response = await client.post(url, content=body, headers=headers)
        status = response.status_code
        raw = response.content
        if status >= 400:
            outcome = classify(status)
            try:
                error = _error_text(msgspec.json.decode(raw), f"http {status}")
            except msgspec.DecodeError:
                error = f"http {status}"
        else:
            try:
                full = _decode_full(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                full = None
            usage = full.usage if full is not None else None
            choices = (full.choices or []) if full is not None else []
            if any(c.text or (c.message is not None and c.message.content) for c in choices):
                outcome = "ok"
            else:
                error = "no output"
    except TimeoutError:
        outcome, error = "timeout", "client deadline"
    except httpx.HTTPError as exc:
        outcome, error = "error", type(exc).__name__
    end = clock()
    return Timeline(
        index=index,
        cls="capacity",
        scheduled=sent - t0,
        sent=sent - t0,
        end=end - t0,
        outcome=outcome,
        status=status,
        error=error,
        e2e=(end - sent) if outcome == "ok" else None,
        output_tokens=usage.completion_tokens if usage is not None else None,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
    )

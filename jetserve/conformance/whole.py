"""The corpus through a gateway's whole (non-streamed) replies: an adapter that asks
for ``stream: false`` and turns the reply body back into the events the runner
checks (one Delta per choice, then Done). Streamed replies need no adapter of their
own: the OpenAI adapter, pointed at a gateway, reads its SSE.

A whole reply cannot be cancelled mid-answer, so the cancellation case does not
apply; an engine stream that broke is the error body's ``stream_interrupted`` code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import msgspec

from streams.wire import Op, Usage
from workers.engines.base import Delta, Done, Embeddings, EngineAdapter, EngineLoad
from workers.engines.http import engine_client, raise_for_status
from workers.errors import EngineRejected, EngineStreamBroken, EngineUnavailable

_PATHS: dict[Op, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def _raise(status: int, body: bytes) -> None:
    try:
        code = msgspec.json.decode(body).get("error", {}).get("code")
    except (msgspec.DecodeError, AttributeError):
        code = None
    if code == "stream_interrupted":
        raise EngineStreamBroken(f"the engine's stream broke ({status})")
    raise_for_status(status, body)


def _calls(message: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    calls = message.get("tool_calls") or []
    return [{**c, "index": i} for i, c in enumerate(calls)] or None


def events(op: Op, reply: Mapping[str, Any]) -> list[Delta | Done]:
    """A whole reply as the events its stream would have made."""
    out: list[Delta | Done] = []
    for choice in reply.get("choices") or []:
        if op == "chat":
            message = choice.get("message") or {}
            text, calls = message.get("content") or "", _calls(message)
        else:
            text, calls = choice.get("text") or "", None
        finish = choice.get("finish_reason") or "stop"
        out.append(Delta(text, calls, finish, choice.get("logprobs"), choice.get("index", 0)))
    first = next((d for d in out if isinstance(d, Delta) and d.index == 0), None)
    u = reply.get("usage") or {}
    details = u.get("prompt_tokens_details") or {}
    usage = Usage(
        prompt_tokens=u.get("prompt_tokens", 0),
        completion_tokens=u.get("completion_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
    )
    finish = first.finish_reason if first is not None and first.finish_reason else "stop"
    out.append(Done(finish, usage, str(reply.get("model", ""))))
    return out


class WholeReplies(EngineAdapter):
    name = "openai-whole"

    def __init__(self, base_url: str, *, api_key: str | None = None) -> None:
        self._client = engine_client(base_url, api_key)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        if op not in _PATHS:
            raise EngineRejected(f"operation {op!r} has no whole reply here")
        payload = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            r = await self._client.post(_PATHS[op], json=payload, headers=dict(headers))
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"gateway unreachable: {exc!r}") from exc
        _raise(r.status_code, r.content)
        for ev in events(op, r.json()):
            yield ev

    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        raise EngineRejected("the conformance corpus has no embedding cases")

    async def load(self) -> EngineLoad:
        return EngineLoad()

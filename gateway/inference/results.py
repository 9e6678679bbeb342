"""Whole results for non-streaming clients: the events of one stream read to
its end, and the OpenAI response made of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.inference.dispatch import error_from_frame
from gateway.inference.openai_types import (
    EmbeddingRequest,
    completion_response,
    embeddings_response,
    merge_logprobs,
)
from gateway.inference.sessions import Admitted
from streams.inference.tool_calls import ToolCalls
from streams.wire import ErrorFrame, Final, Token


@dataclass
class Result:
    text: str
    tool_calls: list[dict[str, Any]]
    final: Final
    logprobs: dict[str, Any] | None = None


async def read_result(adm: Admitted, heartbeat_timeout: float) -> Result:
    """Read the stream to its final frame (a GatewayError for an error frame or
    a stream that ends without one); counts the tokens relayed on ``adm``."""
    text: list[str] = []
    calls = ToolCalls()
    logprobs: list[dict[str, Any] | None] = []
    async for event in adm.stream.events(heartbeat_timeout):
        if isinstance(event, Token):
            adm.tokens_seen += 1
            text.append(event.text)
            if event.tool_calls:
                calls.add(event.tool_calls)
            if event.logprobs:
                logprobs.append(event.logprobs)
        elif isinstance(event, ErrorFrame):
            raise error_from_frame(event)
        else:
            return Result("".join(text), calls.merged(), event, merge_logprobs(logprobs))
    raise AssertionError("frame stream ended without a terminal frame")


def render(adm: Admitted, result: Result) -> dict[str, Any]:
    model = result.final.model or adm.parsed.model
    if isinstance(adm.parsed, EmbeddingRequest):
        return embeddings_response(
            model,
            result.final.embeddings or [],
            result.final.usage,
            adm.parsed.encoding_format,
        )
    return completion_response(
        adm.op,
        adm.request_id,
        model,
        result.text,
        result.tool_calls,
        result.final.finish_reason,
        result.final.usage,
        result.logprobs,
    )

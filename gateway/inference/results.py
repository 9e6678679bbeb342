"""Whole results for non-streaming clients: the events of one stream read to
its end, and the OpenAI response made of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.inference.dispatch import error_from_frame
from gateway.inference.openai_types import (
    ChoiceResult,
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
    choices: list[ChoiceResult]
    final: Final


class _Choice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.calls = ToolCalls()
        self.logprobs: list[dict[str, Any] | None] = []
        self.finish: str | None = None
        self.reasoning: list[str] = []

    def add(self, token: Token) -> None:
        self.text.append(token.text)
        if token.tool_calls:
            self.calls.add(token.tool_calls)
        if token.logprobs:
            self.logprobs.append(token.logprobs)
        if token.reasoning:
            self.reasoning.append(token.reasoning)
        self.finish = token.finish_reason or self.finish

    def result(self) -> ChoiceResult:
        return ChoiceResult(
            self.index,
            "".join(self.text),
            self.calls.merged(),
            self.finish,
            merge_logprobs(self.logprobs),
            "".join(self.reasoning),
        )


async def read_result(adm: Admitted, heartbeat_timeout: float) -> Result:
    """Read the stream to its final frame (a GatewayError for an error frame or
    a stream that ends without one); counts the tokens relayed on ``adm``. Each
    choice (``n`` > 1) is gathered by its index; one that sent no token still
    gets its place, with the final frame's finish reason."""
    choices = {i: _Choice(i) for i in range(adm.choices)}
    async for event in adm.stream.events(heartbeat_timeout):
        if isinstance(event, Token):
            adm.tokens_seen += 1
            if event.index not in choices:
                choices[event.index] = _Choice(event.index)
            choices[event.index].add(event)
        elif isinstance(event, ErrorFrame):
            raise error_from_frame(event)
        else:
            return Result([choices[i].result() for i in sorted(choices)], event)
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
        result.choices,
        result.final.finish_reason,
        result.final.usage,
        adm.created,
    )

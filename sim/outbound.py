"""Response bodies shaped like vLLM's OpenAI server, encoded with msgspec.

Field presence follows vLLM's `exclude_unset` output: a stream delta carries only what
it sets; `usage` appears on a chunk only when it is the usage chunk.
"""

from __future__ import annotations

from typing import Any

import msgspec


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached),
    )


# -- chat stream ---------------------------------------------------------------------


class FunctionDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str  # no default: omit_defaults must never drop it
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- chat non-stream -----------------------------------------------------------------


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    # Only when the reply reasoned (unset: left out of the body).
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    stop_reason: str | None = None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: None = None


# -- text completions ----------------------------------------------------------------


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None


class CompletionChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# -- embeddings, models, tokenize, errors ---------------------------------------------


class EmbeddingData(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # str when encoding_format is base64


class EmbeddingUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class EmbeddingResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "vllm"
    root: str
    parent: str | None = None  # a LoRA adapter's base model, as vLLM lists it
    max_model_len: int


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, frozen=True, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(msgspec.Struct, frozen=True):
    error: ErrorInfo


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    info = ErrorInfo(
        message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status
    )
    return msgspec.json.encode(ErrorResponse(info))


DONE = b"data: [DONE]\n\n"


def sse(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"

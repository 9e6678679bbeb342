"""The public API's response bodies, as Structs: what ``gateway/ingress/openapi.py``
describes with ``msgspec.json.schema_components``.

The gateway renders these bodies as dicts on its hot path
(:mod:`gateway.inference.openai_types`, :mod:`gateway.ingress.api`); the Structs
are their contract, and tests/unit/test_openapi_current.py checks the renderers'
output decodes as them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

Int0 = Annotated[int, Meta(ge=0)]
ToolCalls = Annotated[
    list[dict[str, Any]],
    Meta(description="Tool calls as the engine produced them (OpenAI's shape)."),
]


class ErrorDetail(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    message: str
    type: Annotated[str, Meta(examples=["invalid_request_error"])]
    param: str | None
    code: Annotated[str, Meta(examples=["invalid_api_key"])] | None


class Error(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI's error shape: the openai SDKs raise their usual exceptions."""

    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: Int0


class CompletionUsage(msgspec.Struct, frozen=True):
    prompt_tokens: Int0
    completion_tokens: Int0
    total_tokens: Int0
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


class AssistantMessage(msgspec.Struct, frozen=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: ToolCalls | UnsetType = UNSET


class ChatChoice(msgspec.Struct, frozen=True):
    index: Int0
    message: AssistantMessage
    finish_reason: Annotated[str, Meta(examples=["stop", "length"])]
    logprobs: dict[str, Any] | None = None  # the engine's, as it sent them


class ChatCompletion(msgspec.Struct, frozen=True):
    id: Annotated[str, Meta(pattern="^chatcmpl-")]
    object: Literal["chat.completion"]
    created: Int0
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class CompletionChoice(msgspec.Struct, frozen=True):
    index: Int0
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None  # the engine's, as it sent them


class Completion(msgspec.Struct, frozen=True):
    id: Annotated[str, Meta(pattern="^cmpl-")]
    object: Literal["text_completion"]
    created: Int0
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ChatDelta(msgspec.Struct, frozen=True):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: ToolCalls | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: Int0
    delta: ChatDelta
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # the engine's, as it sent them


class ChatCompletionChunk(msgspec.Struct, frozen=True):
    """One `chat.completion.chunk`. The last one, with `stream_options.include_usage`,
    has no choices and carries `usage`."""

    id: Annotated[str, Meta(pattern="^chatcmpl-")]
    object: Literal["chat.completion.chunk"]
    created: Int0
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | UnsetType = UNSET


class CompletionChunkChoice(msgspec.Struct, frozen=True):
    index: Int0
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # the engine's, as it sent them


class CompletionChunk(msgspec.Struct, frozen=True):
    """One streamed `text_completion` chunk; the usage chunk has no choices."""

    id: Annotated[str, Meta(pattern="^cmpl-")]
    object: Literal["text_completion"]
    created: Int0
    model: str
    choices: list[CompletionChunkChoice]
    usage: CompletionUsage | UnsetType = UNSET


Base64Floats = Annotated[
    str,
    Meta(
        description="`encoding_format: base64`: little-endian float32",
        extra_json_schema={"contentEncoding": "base64"},
    ),
]


class Embedding(msgspec.Struct, frozen=True):
    object: Literal["embedding"]
    index: Int0
    embedding: list[float] | Base64Floats


class EmbeddingUsage(msgspec.Struct, frozen=True):
    prompt_tokens: Int0
    total_tokens: Int0


class Embeddings(msgspec.Struct, frozen=True):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Model(msgspec.Struct, frozen=True):
    id: str
    object: Literal["model"]
    created: Int0
    owned_by: str
    # A LoRA adapter's base model (as vLLM lists it); null for a base model.
    parent: str | None = None


class ModelList(msgspec.Struct, frozen=True):
    object: Literal["list"]
    data: list[Model]


class WsTicket(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ticket: Annotated[
        str,
        Meta(
            pattern="^wst-[A-Za-z0-9_-]{43}$",
            description="Present it once on `/v1/ws`: `?ticket=` or the subprotocol "
            "`jetserve.bearer.<ticket>` (offered with `jetserve.v1`).",
        ),
    ]
    expires_in: Annotated[int, Meta(ge=1, description="Seconds it stays valid.")]


class Health(msgspec.Struct, frozen=True):
    status: Literal["ok"]


class Readiness(msgspec.Struct, frozen=True):
    ready: bool
    checks: Annotated[
        dict[str, bool],
        Meta(description="Each dependency (NATS, Redis, ...) and whether it answers."),
    ]


RESPONSE_TYPES: tuple[type[msgspec.Struct], ...] = (
    Error,
    ChatCompletion,
    Completion,
    ChatCompletionChunk,
    CompletionChunk,
    Embeddings,
    ModelList,
    WsTicket,
    Health,
    Readiness,
)

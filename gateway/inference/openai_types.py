"""OpenAI request validation and response rendering.

Bodies are validated with msgspec against the fields jetserve reads; fields it
does not know pass through untouched to the engine (as vLLM accepts them).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from gateway.errors import BadRequest
from streams.vectors import Vector, floats, packed
from streams.wire import Usage

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
# No model has a context this long; a larger value is bad input, not a budget question.
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
# Examples for the OpenAPI document (gateway/ingress/openapi.py); they do not validate.
ModelName = Annotated[str, msgspec.Meta(examples=["sim-8b"])]
EmbeddingModelName = Annotated[str, msgspec.Meta(examples=["sim-embed"])]


class FunctionSpec(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(msgspec.Struct):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


MAX_CHOICES = 16  # n: capped before any work (each choice may cost max_tokens)


class _Common(msgspec.Struct):
    model: ModelName
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1  # choices, indexed in the frames
    stop: str | list[str] | None = None
    seed: int | None = None


class ChatRequest(_Common):
    """A chat completion request. Fields jetserve does not read pass through to the
    engine unchanged; `n` choices (up to 16) come back indexed. Without `max_tokens`
    (or `max_completion_tokens`) the output is bounded by the gateway's default."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] = []
    max_completion_tokens: MaxTokens | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # Token log-probabilities, relayed as the engine computes them.
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None


class CompletionRequest(_Common):
    """A (legacy) completion request: a prompt as text, token ids, or a batch of either.
    Without `max_tokens` the output is bounded at 16 tokens, as OpenAI's is."""

    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str | int | list[int]] = ""
    # The legacy API's logprobs: this many alternatives per token (0: the sampled one).
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # Carried like any text: the engine's echoed prompt arrives as a delta. best_of
    # sequences are generated (and held for); n of them come back.
    echo: bool | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] | None = None
    suffix: str | None = None


class EmbeddingRequest(msgspec.Struct):
    """An embeddings request. `base64` encodes each vector as little-endian float32."""

    model: EmbeddingModelName
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None


Parsed = ChatRequest | CompletionRequest | EmbeddingRequest
ParsedType = type[ChatRequest] | type[CompletionRequest] | type[EmbeddingRequest]


# Sequences one request may ask for: n (or best_of) x the prompts of a batch.
MAX_SEQUENCES = 2048  # OpenAI's own bound on a batch's inputs
TOO_DEEP = "Request body is nested too deeply."


def parse_body(raw: bytes, kind: ParsedType) -> tuple[Parsed, dict[str, Any]]:
    """Decode and validate; returns the typed view and the raw dict to forward."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object.")
    try:
        typed: Parsed = msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise BadRequest(f"Invalid request: {text}", param=param) from exc
    if isinstance(typed, ChatRequest) and not typed.messages:
        raise BadRequest("'messages' must contain at least one message.", param="messages")
    if isinstance(typed, ChatRequest) and typed.top_logprobs is not None and not typed.logprobs:
        raise BadRequest("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    best_of = typed.best_of if isinstance(typed, CompletionRequest) else None
    if best_of is not None and best_of < getattr(typed, "n", 1):
        raise BadRequest("'best_of' must be at least 'n'.", param="best_of")
    if isinstance(typed, EmbeddingRequest) and _inputs(typed) > MAX_SEQUENCES:
        # Each input is a vector the engine computes and the worker holds before the
        # answer's size is known: 20,000 short ones were a 41 MB answer, refused only
        # after the engine had embedded them all.
        raise BadRequest(
            f"An embeddings request may carry at most {MAX_SEQUENCES} inputs.", param="input"
        )
    if sequences_of(typed) > MAX_SEQUENCES:
        # Before any hold: each choice is state in the gateway (and a sequence in
        # the engine); n x a batch of 100,000 prompts was 1.6 M of them, built at once.
        raise BadRequest(
            f"A request may ask for at most {MAX_SEQUENCES} sequences: 'n' (or "
            "'best_of') times the prompts of a batch.",
            param="n",
        )
    return typed, body


def _prompts(parsed: object) -> int:
    """A completions batch (a list of strings or of token-id lists) has one prompt
    per item; anything else is one."""
    prompt = getattr(parsed, "prompt", None)
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 1


def _inputs(req: EmbeddingRequest) -> int:
    """An embeddings request's inputs: a list of texts or of token-id lists has one
    per item; a text, or one list of token ids, is one."""
    items = req.input
    if isinstance(items, list) and items and not all(isinstance(t, int) for t in items):
        return len(items)
    return 1


def choices_of(parsed: object) -> int:
    """How many choices the reply has: ``n`` per prompt."""
    return int(getattr(parsed, "n", 1)) * _prompts(parsed)


def sequences_of(parsed: object) -> int:
    """How many sequences the engine generates, each up to ``max_tokens``: ``n``,
    or ``best_of`` when larger, per prompt (what holds and KV budgets are for)."""
    n = int(getattr(parsed, "n", 1))
    return max(n, int(getattr(parsed, "best_of", None) or 1)) * _prompts(parsed)


# Non-text content parts (images, audio, files) cost tokens the bytes of the
# request don't show; a generous fixed allowance keeps the hold an upper bound.
NON_TEXT_PART_TOKENS = 4096


def _text_bytes(content: object) -> int:
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type", "text") == "text":
                total += _text_bytes(part.get("text", ""))
            else:
                total += NON_TEXT_PART_TOKENS
        return total
    return 0


def _input_units(inp: str | list[str | int | list[int]]) -> tuple[int, int]:
    """(bytes of text, token ids given directly) of a prompt or embedding input."""
    if isinstance(inp, str):
        return _text_bytes(inp), 0
    text = sum(_text_bytes(x) for x in inp if isinstance(x, str))
    ids = sum(len(x) if isinstance(x, list) else 1 for x in inp if not isinstance(x, str))
    return text, ids


def _prompt_units(req: Parsed) -> tuple[int, int, int]:
    """(bytes of text, token ids, messages) that the engine will tokenize."""
    if isinstance(req, ChatRequest):
        text = sum(_text_bytes(m.content) + len((m.name or "").encode()) for m in req.messages)
        text += sum(len(msgspec.json.encode(m.tool_calls)) for m in req.messages if m.tool_calls)
        if req.tools:
            text += len(msgspec.json.encode(req.tools))  # rendered into the prompt
        if req.response_format:
            text += len(msgspec.json.encode(req.response_format))
        return text, 0, len(req.messages)
    # Each input of a batch (a completions prompt, an embedding input) gets the
    # model's special tokens ([CLS]/[SEP], BOS): a "message"'s allowance each. One
    # for the request held 32 tokens for 500 empty inputs that cost 1000.
    if isinstance(req, CompletionRequest):
        return (*_input_units(req.prompt), _prompts(req))
    return (*_input_units(req.input), _inputs(req))


def estimate_prompt_tokens(req: Parsed) -> int:
    """A typical count (4 bytes/token) for KV admission; never for money."""
    text, ids, messages = _prompt_units(req)
    return text // 4 + ids + 8 * messages + 1


# Bytes per token, at most, over a whole prompt: real tokenizers average 3-5 on
# text; 16 leaves room for code and long whitespace runs.
MAX_BYTES_PER_TOKEN = 16


def floor_prompt_tokens(req: Parsed) -> int:
    """A lower bound for the context check: token ids count as they are, text at
    no fewer than one token per ``MAX_BYTES_PER_TOKEN`` bytes, no template. A
    request refused on it would not fit whatever the tokenizer."""
    text, ids, _ = _prompt_units(req)
    return text // MAX_BYTES_PER_TOKEN + ids


def bound_prompt_tokens(req: Parsed) -> int:
    """An upper bound for budget holds: a token covers at least one byte of text
    (byte-level BPE), plus a generous allowance per message for the chat template.
    Holding less than the real cost would let concurrent requests overrun a budget."""
    text, ids, messages = _prompt_units(req)
    return text + ids + 16 * messages + 16


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def merge_logprobs(parts: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Several deltas' ``logprobs`` as one, as a client joining the stream would:
    each list (chat's ``content`` and ``refusal``, the completions API's
    ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) is
    concatenated in order. None when no part carries any."""
    present = [p for p in parts if p]
    if len(present) <= 1:
        return dict(present[0]) if present else None
    merged: dict[str, Any] = {}
    for part in present:
        for key, value in part.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            elif value is not None or key not in merged:
                merged[key] = value
    return merged


class ChunkWriter:
    """Renders OpenAI stream chunks for one request (chat or completion)."""

    def __init__(self, op: str, request_id: str, model: str, created: float) -> None:
        self.chat = op == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.model = model
        # The request's acceptance, not this rendering's: a resumed stream or an
        # Idempotency-Key retry renders the same chunks on another replica later.
        self.created = int(created)
        self.role_sent = False  # choice 0's role chunk
        self._roles: set[int] = set()  # choices whose first delta went out

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def delta(
        self,
        text: str,
        tool_calls: list[dict[str, Any]] | None,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
        reasoning: str | None = None,
    ) -> list[dict[str, Any]]:
        """The chunks of one choice's delta: choice 0's first is preceded by the role
        chunk (its own event id, see sse.py); another choice's first delta carries
        the role itself."""
        out: list[dict[str, Any]] = []
        if not self.chat:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            return [self._chunk([choice])]
        delta: dict[str, Any] = {}
        if index == 0 and not self.role_sent:
            self.role_sent = True
            role = {"role": "assistant", "content": ""}
            out.append(
                self._chunk([{"index": 0, "delta": role, "logprobs": None, "finish_reason": None}])
            )
        elif index and index not in self._roles:
            delta["role"] = "assistant"
        self._roles.add(index)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        out.append(self._chunk([choice]))
        return out

    def finish(self, finish_reason: str, indexes: Sequence[int] = (0,)) -> dict[str, Any]:
        """A closing chunk, for the choices whose last token frame did not carry
        the reason."""
        body: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        return self._chunk(
            [
                {"index": i, **body, "logprobs": None, "finish_reason": finish_reason}
                for i in indexes
            ]
        )

    def usage(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([], usage=usage_json(usage))


@dataclass
class ChoiceResult:
    """One choice of a whole (non-streamed) reply."""

    index: int = 0
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None  # None: the final frame's
    logprobs: dict[str, Any] | None = None
    reasoning: str = ""  # a reasoning model's thinking (``reasoning_content``)


def completion_response(
    op: str,
    request_id: str,
    model: str,
    choices: list[ChoiceResult],
    finish_reason: str,
    usage: Usage,
    created: float,
) -> dict[str, Any]:
    """``created``: when the request was accepted (an Idempotency-Key retry renders
    the same response later, on any replica, and must match it byte for byte)."""
    rendered: list[dict[str, Any]] = []
    for c in choices:
        finish = c.finish_reason or finish_reason
        if op == "chat":
            message: dict[str, Any] = {
                "role": "assistant",
                "content": c.text if c.text or not c.tool_calls else None,
            }
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            if c.reasoning:
                message["reasoning_content"] = c.reasoning
            rendered.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": c.logprobs,
                    "finish_reason": finish,
                }
            )
        else:
            rendered.append(
                {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": finish}
            )
    obj, prefix = ("chat.completion", "chatcmpl-") if op == "chat" else ("text_completion", "cmpl-")
    return {
        "id": prefix + request_id,
        "object": obj,
        "created": int(created),
        "model": model,
        "choices": rendered,
        "usage": usage_json(usage),
    }


def embeddings_response(
    model: str, vectors: list[Vector], usage: Usage, encoding: str = "float"
) -> dict[str, Any]:
    # base64 is OpenAI's: little-endian float32 (what its SDK asks for by default).
    data: list[dict[str, Any]] = [
        {
            "object": "embedding",
            "index": i,
            "embedding": (
                base64.b64encode(packed(v)).decode() if encoding == "base64" else floats(v)
            ),
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }

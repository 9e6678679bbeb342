"""Request bodies (msgspec Structs) and their validation, shaped like vLLM's OpenAI server.

Unknown fields are ignored, as OpenAI-compatible servers do; a wrong type is a 400.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from sim.logprobs import MAX_TOP

MAX_CHOICES = 16  # n: choices per request

_T = TypeVar("_T")


class ApiError(Exception):
    """A client error that becomes an OpenAI-shaped error response."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(ApiError):
    status = 400


class NotFound(ApiError):
    status = 404


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    # str, or OpenAI content parts ([{"type": "text", "text": ...}, ...]), or null
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        return content_text(self.content)


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None  # vLLM falls back to the served model when absent
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM extension, used by benchmarks to force max_tokens
    # Applied to the natural text as sim/sampling.py says; checked as vLLM checks them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension
    top_k: int | None = None  # vLLM extension
    min_p: float = 0.0  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    logit_bias: dict[str, float] | None = None
    # Structured output (sim/structured.py): OpenAI's, and vLLM's older and newer options.
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_choice: Any = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: the prefix cache reused only between requests of one salt.
    cache_salt: str | None = None


class ChatRequest(_Sampling, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # False: at most one call
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; a msgspec union cannot hold two list
    # types, so the shape is checked by prompt_input().
    prompt: str | list[Any]
    logprobs: int | None = None  # the legacy API: this many alternatives per token
    echo: bool = False  # the prompt comes back ahead of the completion
    best_of: int | None = None  # sequences generated; n of them returned
    suffix: str | None = None  # refused, as vLLM refuses it


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    # vLLM's: each input cut to its last K tokens (-1: to the model's length).
    truncate_prompt_tokens: int | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class ScriptedToolCall(msgspec.Struct, frozen=True, kw_only=True):
    function: dict[str, Any]  # {"name": str, "arguments": str | object}
    id: str | None = None
    type: str = "function"


class ScriptedResponse(msgspec.Struct, frozen=True, kw_only=True):
    content: str | None = None
    tool_calls: list[ScriptedToolCall] | None = None
    # Streamed first as ``delta.reasoning_content``, as vLLM's reasoning parsers do.
    reasoning: str | None = None


class ScriptMatch(msgspec.Struct, frozen=True, kw_only=True):
    last_user: str | None = None  # regex searched in the last message, if a user turn
    last_role: str | None = None  # exact role of the last message
    contains: str | None = None  # substring of the rendered prompt


class ScriptRule(msgspec.Struct, frozen=True, kw_only=True):
    response: ScriptedResponse
    match: ScriptMatch = msgspec.field(default_factory=ScriptMatch)
    times: int | None = None  # None: unlimited


def decode(body: bytes, kind: type[_T]) -> _T:
    if not body:
        raise BadRequest("request body is empty")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"malformed JSON: {e}") from None


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            parts.append("<|media|>")  # non-text parts count as one placeholder token
    return "".join(parts)


def check_sampling(req: _Sampling, max_tokens: int | None) -> None:
    if not 1 <= req.n <= MAX_CHOICES:
        raise BadRequest(f"n must be between 1 and {MAX_CHOICES}", "n")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", "max_tokens")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")


def logprobs_top(req: _Sampling) -> int | None:
    """How many alternatives per token the reply's logprobs list (None: no logprobs),
    checked as vLLM checks them."""
    if isinstance(req, ChatRequest):
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if not req.logprobs:
            return None
        top, param = top or 0, "top_logprobs"
    elif isinstance(req, CompletionRequest):
        if req.logprobs is None:
            return None
        top, param = req.logprobs, "logprobs"
    else:
        return None
    if not 0 <= top <= MAX_TOP:
        raise BadRequest(f"{param} must be between 0 and {MAX_TOP}", param)
    return top


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def prompt_input(prompt: str | list[Any]) -> str | list[int]:
    """One completion prompt: text or token ids. Batched prompts are not simulated."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if len(prompt) == 1 and isinstance(prompt[0], list):
        return prompt_input(prompt[0])
    if len(prompt) > 1:
        raise BadRequest("the simulator serves one prompt per request", "prompt")
    raise BadRequest("prompt must be a string or a list of token ids", "prompt")


def embedding_inputs(inp: str | list[Any]) -> list[str | list[int]]:
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise BadRequest("input must not be empty", "input")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in inp):
        return [list(inp)]
    out: list[str | list[int]] = []
    for item in inp:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            out.append(list(item))
        else:
            raise BadRequest("input must be str, list[str], list[int] or list[list[int]]", "input")
    return out

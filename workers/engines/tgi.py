"""Adapter for Hugging Face Text Generation Inference's native API (``/generate_stream``).

TGI takes one prompt string (``inputs``) and ``parameters``; it streams SSE events
``{"token": {...}, "generated_text": null | str, "details": null | {...}}``, the last
one with ``details.finish_reason`` (length | eos_token | stop_sequence),
``generated_tokens`` and ``input_length``. Errors are ``{"error", "error_type"}``
(422 validation, 429 overloaded, 424/500 generation), also as an SSE event mid-stream.
The translation of each OpenAI field is declared in :data:`TGI_TRANSLATIONS`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import msgspec

from streams.wire import Op, Usage
from workers.engines import prompted
from workers.engines import translation as t
from workers.engines.base import Delta, Done, Embeddings, EngineAdapter, EngineLoad
from workers.engines.http import engine_client, open_stream, probe, raise_for_status, scrape
from workers.engines.translation import FieldStatus, Translated
from workers.errors import EngineRejected, EngineStreamBroken

T, E, R, P, NA = (
    FieldStatus.TRANSFORMED,
    FieldStatus.EMULATED,
    FieldStatus.REJECTED,
    FieldStatus.PASSED,
    FieldStatus.NOT_APPLICABLE,
)
_UNMAPPED = "not mapped to TGI's parameters: 400 unsupported_parameter"
TGI_TRANSLATIONS: Mapping[str, Translated] = {
    t.MESSAGES: Translated(T, "rendered to one prompt with the ChatML template"),
    t.CONTENT_PARTS: Translated(R, "one prompt string: only text parts (400 otherwise)"),
    t.MAX_TOKENS: Translated(T, "max_tokens -> parameters.max_new_tokens"),
    t.MAX_COMPLETION_TOKENS: Translated(T, "-> parameters.max_new_tokens"),
    t.FINISH_REASON: Translated(T, "eos_token / stop_sequence -> stop, length -> length"),
    t.TOOLS: Translated(
        E,
        "Hermes <tools> in the system turn, <tool_call> blocks parsed from the reply; "
        "replies of tool-enabled requests arrive in one piece at the end",
    ),
    t.TOOL_CHOICE: Translated(
        E,
        "none: the tools are left out of the prompt; required or a named function: "
        "a JSON grammar forces the call; auto: the model decides",
    ),
    t.PARALLEL_TOOL_CALLS: Translated(E, "false: the first parsed call is kept"),
    t.RESPONSE_FORMAT: Translated(
        T, 'json_schema/json_object -> parameters.grammar {"type": "json"}'
    ),
    t.STOP: Translated(
        T, "-> parameters.stop; TGI keeps the stop string in its output, the adapter cuts it"
    ),
    t.SEED: Translated(T, "-> parameters.seed"),
    t.TEMPERATURE: Translated(T, "0 -> greedy (TGI's default): temperature and seed are left out"),
    t.PENALTIES: Translated(R, _UNMAPPED),
    t.LOGIT_BIAS: Translated(R, "TGI has no logit bias: 400 unsupported_parameter"),
    t.LOGPROBS: Translated(R, _UNMAPPED),
    t.N: Translated(R, "one sequence per TGI request: n > 1 is 400 unsupported_parameter"),
    t.ECHO: Translated(R, _UNMAPPED),
    t.BEST_OF: Translated(R, _UNMAPPED),
    t.TOP_K: Translated(R, _UNMAPPED),
    t.MIN_P: Translated(R, "TGI has no min_p: 400 unsupported_parameter"),
    t.MIN_TOKENS: Translated(R, "TGI has no min_tokens: 400 unsupported_parameter"),
    t.REPETITION_PENALTY: Translated(R, _UNMAPPED),
    t.IGNORE_EOS: Translated(R, "TGI has no ignore_eos: 400 unsupported_parameter"),
    t.STRUCTURED_OUTPUTS: Translated(
        R, "vLLM's options: 400 unsupported_parameter (response_format is carried)"
    ),
    t.USAGE: Translated(
        T, "details.input_length / details.generated_tokens (usage is always returned)"
    ),
    t.CACHED_TOKENS: Translated(NA, "TGI reports no prefix-cache hits: cached_tokens is 0"),
    t.CANCELLATION: Translated(P, "closing the SSE connection stops TGI's generation"),
    t.ERR_CONTEXT: Translated(T, "422 validation error -> EngineRejected (400)"),
    t.ERR_MODEL: Translated(
        NA,
        "TGI serves one model and its API names none; the gateway answers 404 for a "
        "model it does not route",
    ),
    t.ERR_INVALID: Translated(R, "presence_penalty is not mapped: 400 unsupported_parameter"),
    t.ERR_429: Translated(T, "429 overloaded -> EngineRateLimited"),
    t.ERR_5XX: Translated(P, "5xx -> EngineUnavailable"),
    t.ERR_MALFORMED: Translated(P, "undecodable SSE event -> EngineStreamBroken"),
}

_CARRIED = (
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
)
_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
_METRIC = re.compile(r"^(tgi_[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$")


class _Token(msgspec.Struct):
    text: str = ""
    special: bool = False


class _Details(msgspec.Struct):
    finish_reason: str = ""
    generated_tokens: int = 0
    input_length: int | None = None


class _Event(msgspec.Struct):
    token: _Token | None = None
    details: _Details | None = None
    error: str | None = None
    error_type: str | None = None


_event_decoder = msgspec.json.Decoder(_Event)
_encoder = msgspec.json.Encoder()


def _raise(status: int, body: bytes) -> None:
    if status == 422:  # TGI's validation errors (context length, bad parameters)
        raise_for_status(400, body)
    raise_for_status(status, body)


class _Request:
    """One OpenAI body translated to TGI's parameters."""

    def __init__(self, op: Op, body: Mapping[str, Any]) -> None:
        prompted.check_fields(body, _CARRIED, "TGI")
        self.tools = list(body.get("tools") or [])
        self.one_call = body.get("parallel_tool_calls") is False
        choice = body.get("tool_choice")
        if choice == "none":
            self.tools = []
        self.forced: dict[str, Any] | None = None
        if self.tools and (choice == "required" or isinstance(choice, dict)):
            self.forced = _forced_schema(self.tools, choice)
        if op == "chat":
            self.prompt = prompted.render_chatml(list(body.get("messages") or []), self.tools)
        elif isinstance(body.get("prompt"), str):
            self.prompt = str(body["prompt"])
        else:
            raise EngineRejected("the TGI adapter takes one prompt string")
        self.stops = prompted.stop_list(body)
        params: dict[str, Any] = {"details": True}
        limit = prompted.max_tokens(body)
        if limit is not None:
            params["max_new_tokens"] = limit
        for key in ("temperature", "top_p", "seed"):
            if body.get(key) is not None:
                params[key] = body[key]
        if params.get("temperature") == 0:
            # TGI wants > 0; greedy is its default, and a seed means nothing to it.
            params.pop("temperature")
            params.pop("seed", None)
        if self.stops:
            params["stop"] = self.stops
        grammar = _grammar(body.get("response_format"))
        if self.forced is not None:
            if grammar is not None:
                raise EngineRejected("TGI takes one grammar: tool_choice or response_format")
            grammar = {"type": "json", "value": self.forced}
        if grammar is not None:
            params["grammar"] = grammar
        self.payload = {"inputs": self.prompt, "parameters": params}


def _grammar(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json", "value": {"type": "object"}}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise EngineRejected("response_format.json_schema.schema must be an object")
        return {"type": "json", "value": schema}
    raise EngineRejected(f"response_format type {kind!r} is not supported by TGI")


def _forced_schema(tools: list[dict[str, Any]], choice: Any) -> dict[str, Any]:
    """A JSON schema that only a call of the chosen tool (or any tool) satisfies."""
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    options = []
    for tool in tools:
        fn = tool.get("function", {})
        if name is not None and fn.get("name") != name:
            continue
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn.get("name")},
                    "arguments": fn.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
        )
    if not options:
        raise EngineRejected(f"tool_choice names an unknown tool {name!r}")
    return options[0] if len(options) == 1 else {"anyOf": options}


class TGIAdapter(EngineAdapter):
    name = "tgi"
    translations = TGI_TRANSLATIONS

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str = "",
        max_connections: int = 256,
        connect_timeout: float = 5.0,
    ) -> None:
        self.model = model
        self._client = engine_client(
            base_url, api_key, max_connections=max_connections, connect_timeout=connect_timeout
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        if op not in ("chat", "completion"):
            raise EngineRejected(f"operation {op!r} does not stream")
        req = _Request(op, body)
        hdrs = {"X-Request-Id": request_id, "Content-Type": "application/json", **headers}
        request = self._client.build_request(
            "POST", "/generate_stream", content=_encoder.encode(req.payload), headers=hdrs
        )
        async with open_stream(self._client, request, _raise) as response:
            async for event in self._events(response, req):
                yield event

    async def _events(self, response: httpx.Response, req: _Request) -> AsyncIterator[Delta | Done]:
        trimmer = prompted.StopTrimmer(req.stops)
        buffered = bool(req.tools)  # tool calls are parsed from the whole reply
        text = ""
        details: _Details | None = None
        async for data in prompted.sse_data(response):
            try:
                event = _event_decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise EngineStreamBroken(f"malformed chunk from engine: {exc}") from exc
            if event.error is not None:
                raise EngineStreamBroken(f"engine failed mid-stream: {event.error}")
            if event.token is not None and not event.token.special:
                piece = trimmer.push(event.token.text)
                if buffered:
                    text += piece
                elif piece:
                    yield Delta(piece)
            if event.details is not None:
                details = event.details
                break
        if details is None:
            raise EngineStreamBroken("engine stream ended without a finish reason")
        tail = trimmer.flush()
        finish = _FINISH.get(details.finish_reason, details.finish_reason or "stop")
        if buffered:
            content, calls = prompted.parse_tool_calls(text + tail, req.forced is not None)
            if req.one_call:
                calls = calls[:1]
            if calls:
                if content:
                    yield Delta(content)
                yield Delta("", calls, "tool_calls")
                finish = "tool_calls"
            else:
                yield Delta(content, None, finish)
        else:
            yield Delta(tail, None, finish)
        usage = Usage(
            prompt_tokens=details.input_length or 0,
            completion_tokens=details.generated_tokens,
        )
        yield Done(finish, usage, self.model)

    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        raise EngineRejected("TGI serves generation only; embeddings need an embedding engine")

    async def healthy(self) -> bool:
        return await probe(self._client, "/health")

    async def load(self) -> EngineLoad:
        text = await scrape(self._client, "/metrics")
        return EngineLoad() if text is None else parse_tgi_metrics(text)


def parse_tgi_metrics(text: str) -> EngineLoad:
    """TGI's queue and batch gauges; it exposes no KV-cache usage."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m is not None:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return EngineLoad(
        waiting=values.get("tgi_queue_size"),
        running=values.get("tgi_batch_current_size"),
    )

"""Shared pieces of the prompt-string dialects (TGI, Triton): they take one prompt string,
so chat messages are rendered here, and features the engine lacks are emulated here.

Chat template: ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then
``<|im_start|>assistant\\n``), the template of Qwen2/2.5, Hermes and many fine-tunes.
Tools follow the Hermes / Qwen2.5 convention: the definitions go into the system turn
inside ``<tools></tools>``, the model answers ``<tool_call>{"name", "arguments"}
</tool_call>`` blocks, which :func:`parse_tool_calls` turns back into OpenAI tool calls.
A deployment whose model uses another template needs another renderer (and is another
deployment fingerprint); this one is what the translation-loss report describes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, NoReturn, Protocol, TypeVar

import httpx
import msgspec

from workers.engines.http import lines, raise_for_status
from workers.errors import (
    EngineRejected,
    EngineStreamBroken,
    EngineUnsupported,
)

# Fields that describe the call rather than the generation: the adapters consume them.
METADATA_FIELDS = frozenset({"model", "stream", "stream_options", "user", "n"})

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def check_fields(
    body: Mapping[str, Any],
    carried: Iterable[str],
    dialect: str,
    engine_lacks: Mapping[str, str] | None = None,
) -> None:
    """Reject any field the adapter would otherwise have to drop silently: 400
    ``unsupported_parameter``, saying why when the engine lacks it (``engine_lacks``:
    field -> what the engine has instead, or nothing)."""
    carried = tuple(carried)
    allowed = METADATA_FIELDS.union(carried)
    # None and False ask for nothing (``"logprobs": false`` is OpenAI's default).
    unknown = sorted(
        k for k, v in body.items() if k not in allowed and v is not None and v is not False
    )
    lacks = engine_lacks or {}
    known = [k for k in unknown if k in lacks]
    if known:
        raise EngineUnsupported(
            "; ".join(f"{dialect} cannot do {k}: {lacks[k]}" for k in known)
            + "; remove it or route to an engine that has it"
        )
    if unknown:
        raise EngineUnsupported(
            f"the {dialect} adapter cannot carry {', '.join(unknown)}; remove "
            f"{'them' if len(unknown) > 1 else 'it'} or route to an OpenAI-compatible engine"
        )
    if "n" not in carried and body.get("n", 1) not in (1, None):
        raise EngineUnsupported(f"the {dialect} adapter serves n=1 only")


def max_tokens(body: Mapping[str, Any]) -> int | None:
    """The answer's length limit: ``max_completion_tokens``, else ``max_tokens``. An
    explicit null of the first is its absence (it hid ``max_tokens``: TGI ran to
    the context length, past the hold; Triton's engine cut at its default 16)."""
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    return int(value) if value is not None else None


def stop_list(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type", "text") != "text":
            raise EngineRejected("prompt-string engines take text content parts only")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def render_chatml(
    messages: list[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> str:
    out: list[str] = []
    rest = list(messages)
    system = ""
    if rest and rest[0].get("role") in ("system", "developer"):
        system = _text(rest.pop(0).get("content"))
    if tools:
        defs = "\n".join(json.dumps(t.get("function", t), sort_keys=True) for t in tools)
        system = (
            f"{system}\n\n# Tools\n\nYou may call one or more functions to assist with the "
            f"user query.\n\n<tools>\n{defs}\n</tools>\n\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
            "\n</tool_call>"
        ).lstrip()
    if system:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for m in rest:
        role = str(m.get("role", "user"))
        body = _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                try:
                    parsed = json.loads(args) if isinstance(args, str) and args else args
                except ValueError as exc:  # the client's history: its error, a 400
                    raise EngineRejected(
                        f"messages: a tool call's arguments are not JSON: {exc}"
                    ) from exc
                payload = json.dumps({"name": fn.get("name"), "arguments": parsed})
                body += f"\n<tool_call>\n{payload}\n</tool_call>"
        elif role == "tool":
            role, body = "user", f"<tool_response>\n{body}\n</tool_response>"
        elif role == "developer":
            role = "system"
        out.append(f"<|im_start|>{role}\n{body}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def parse_tool_calls(text: str, forced: bool) -> tuple[str, list[dict[str, Any]]]:
    """Split a reply into plain text and OpenAI-shaped tool calls.

    A forced call (tool_choice named or required, generated under a JSON grammar) is the
    bare JSON object; otherwise calls are the ``<tool_call>`` blocks.
    """
    blocks = _TOOL_CALL.findall(text)
    if not blocks and forced and text.strip().startswith("{"):
        blocks = [text.strip()]
    calls: list[dict[str, Any]] = []
    for i, raw in enumerate(blocks):
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise EngineStreamBroken(f"model emitted a malformed tool call: {exc}") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise EngineStreamBroken("model emitted a tool call without a name")
        args = obj.get("arguments", {})
        calls.append(
            {
                "index": i,
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if not calls:
        return text, []
    return _TOOL_CALL.sub("", text).strip() if not forced else "", calls


class StopTrimmer:
    """Holds back a tail that could be the start of a stop string, and cuts at a match.

    For engines whose output still contains the stop string (TGI does).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.matched = False

    def push(self, piece: str) -> str:
        if self.matched:
            return ""
        self.text += piece
        cut = min((i for s in self.stops if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text, self.matched = self.text[:cut], True
            return self.flush()
        safe = len(self.text) - self.hold
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : safe], safe
        return delta

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE stream (TGI and Triton both use SSE)."""
    async for line in lines(response):
        if line.startswith("data:"):
            data = line[5:].strip()
            if data:
                yield data


class _Failing(Protocol):
    @property
    def error(self) -> str | None: ...


E = TypeVar("E", bound=_Failing)


def _raise_in_band(error: str, kind: str | None) -> NoReturn:
    """An error event of the stream (TGI answers 200 and sends every error of a
    stream this way): an overload is retried (429), a validation error is the
    caller's (400, with the engine's message); anything else broke the stream."""
    body = msgspec.json.encode({"error": {"message": error}})
    if kind == "overloaded":
        raise_for_status(429, body)
    if kind == "validation":
        raise_for_status(400, body)
    raise EngineStreamBroken(f"engine failed mid-stream: {error}")


async def sse_events(
    response: httpx.Response, decoder: msgspec.json.Decoder[E]
) -> AsyncIterator[E]:
    """Each `data:` payload decoded; a malformed one, or one that carries the
    engine's own ``error``, breaks the stream (TGI's and Triton's events both do)."""
    async for data in sse_data(response):
        try:
            event = decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise EngineStreamBroken(f"malformed chunk from engine: {exc}") from exc
        if event.error is not None:
            _raise_in_band(event.error, getattr(event, "error_type", None))
        yield event

"""What a conformance request produced, per choice: text, tool calls, finish reason and
logprobs, gathered from the adapter's Delta events, and its Done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.engines.base import Delta, Done


@dataclass
class ChoiceOut:
    text: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish: str | None = None
    # One (token, alternatives listed) per generated token, from either API's shape.
    logprobs: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class Outcome:
    choices: dict[int, ChoiceOut] = field(default_factory=dict)
    done: Done | None = None
    deltas: int = 0

    def choice(self, index: int = 0) -> ChoiceOut:
        return self.choices.setdefault(index, ChoiceOut())

    @property
    def text(self) -> str:
        return self.choice(0).text

    @property
    def tool_calls(self) -> dict[int, dict[str, str]]:
        return self.choice(0).tool_calls

    def add(self, ev: Delta) -> None:
        self.deltas += 1
        c = self.choice(ev.index)
        c.text += ev.text
        for call in ev.tool_calls or []:
            _merge_call(c.tool_calls, call)
        if ev.finish_reason:
            c.finish = ev.finish_reason
        if ev.logprobs:
            c.logprobs.extend(_entries(ev.logprobs))


def _entries(lp: dict[str, Any]) -> list[tuple[str, int]]:
    """Chat's ``{"content": [{token, top_logprobs}]}`` or the completions API's
    parallel lists (``tokens``, ``top_logprobs``: one dict per token)."""
    if "content" in lp:
        return [
            (str(e.get("token", "")), len(e.get("top_logprobs") or [])) for e in lp["content"] or []
        ]
    tops = lp.get("top_logprobs") or []
    tokens = lp.get("tokens") or []
    return [(str(tok), len(tops[i] or {}) if i < len(tops) else 0) for i, tok in enumerate(tokens)]


def _merge_call(calls: dict[int, dict[str, str]], delta: dict[str, Any]) -> None:
    """OpenAI streams a call in pieces: id and name first, then argument fragments."""
    index = int(delta.get("index", len(calls)))
    slot = calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
    if delta.get("id"):
        slot["id"] = str(delta["id"])
    fn = delta.get("function") or {}
    if fn.get("name"):
        slot["name"] = str(fn["name"])
    if fn.get("arguments"):
        slot["arguments"] += str(fn["arguments"])

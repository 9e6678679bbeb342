"""Scripted responses for agent tests: the first matching rule decides the reply.

Rules are JSON: [{"match": {"last_user": regex, "last_role": "tool", "contains": str},
"response": {"content": str, "tool_calls": [...]}, "times": int}]. All given matchers
must hold: `last_user` is searched in the last message when that message is a user turn
(so an agent's next turn, after a tool result, falls through to a `last_role: tool`
rule); `contains` is a substring of the rendered prompt. A rule with `times` is used
that many times, then skipped. `X-Sim-Script: <response json>` overrides per request.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from sim.inbound import BadRequest, ScriptedResponse, ScriptRule


class Conversation(msgspec.Struct, frozen=True):
    """What rules match against."""

    last_user: str | None  # the last message's text when it is a user turn
    last_role: str
    prompt: str  # the rendered prompt (chat template applied)


class _Loaded:
    def __init__(self, rule: ScriptRule) -> None:
        self.rule = rule
        self.pattern = re.compile(rule.match.last_user) if rule.match.last_user else None
        self.left = rule.times

    def matches(self, conv: Conversation) -> bool:
        if self.left is not None and self.left <= 0:
            return False
        m = self.rule.match
        if m.last_role is not None and m.last_role != conv.last_role:
            return False
        if m.contains is not None and m.contains not in conv.prompt:
            return False
        if self.pattern is None:
            return True
        return conv.last_user is not None and self.pattern.search(conv.last_user) is not None


def parse_rules(data: bytes) -> list[ScriptRule]:
    """A JSON list of rules, or {"rules": [...]}."""
    try:
        raw = msgspec.json.decode(data)
        if isinstance(raw, dict) and "rules" in raw:
            raw = raw["rules"]
        rules = msgspec.convert(raw, list[ScriptRule])
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise BadRequest(f"invalid script rules: {e}") from None
    for r in rules:
        if r.match.last_user:
            try:
                re.compile(r.match.last_user)
            except re.error as e:
                raise BadRequest(f"invalid last_user regex {r.match.last_user!r}: {e}") from None
    return rules


def parse_response(data: str) -> ScriptedResponse:
    try:
        return msgspec.json.decode(data.encode(), type=ScriptedResponse)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise BadRequest(f"invalid X-Sim-Script header: {e}") from None


class ScriptBook:
    def __init__(self) -> None:
        self._rules: list[_Loaded] = []

    @classmethod
    def from_file(cls, path: str | None) -> ScriptBook:
        book = cls()
        if path:
            book.load(parse_rules(Path(path).read_bytes()))
        return book

    def load(self, rules: list[ScriptRule], append: bool = False) -> None:
        loaded = [_Loaded(r) for r in rules]
        self._rules = [*self._rules, *loaded] if append else loaded

    def clear(self) -> None:
        self._rules = []

    def __len__(self) -> int:
        return len(self._rules)

    def describe(self) -> list[dict[str, object]]:
        return [{"rule": msgspec.to_builtins(r.rule), "left": r.left} for r in self._rules]

    def pick(self, conv: Conversation) -> ScriptedResponse | None:
        for r in self._rules:
            if r.matches(conv):
                if r.left is not None:
                    r.left -= 1
                return r.rule.response
        return None

"""Tool calling on an engine without a tool parser (TGI's and Triton's generate APIs):
the tools go into the prompt (Hermes convention, :func:`prompted.render_chatml`), a
``required`` or named ``tool_choice`` becomes a JSON grammar that only such a call
satisfies, and the ``<tool_call>`` blocks of the whole reply become OpenAI tool calls
(``parallel_tool_calls=false`` keeps the first). ``tool_choice="none"`` leaves the tools
out of the prompt."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.engines import prompted
from workers.engines.base import Delta
from workers.errors import EngineRejected


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


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict[str, Any]]
    forced: dict[str, Any] | None  # the JSON schema a forced call must satisfy
    one_call: bool

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> ToolPlan:
        tools = list(body.get("tools") or [])
        choice = body.get("tool_choice")
        if not tools and choice not in (None, "none", "auto"):
            raise EngineRejected("When using `tool_choice`, `tools` must be set.")
        if choice == "none":
            tools = []
        forced = None
        if tools and (choice == "required" or isinstance(choice, dict)):
            forced = _forced_schema(tools, choice)
        return cls(tools, forced, body.get("parallel_tool_calls") is False)

    def reply(
        self, text: str, index: int, finish: str, logprobs: dict[str, Any] | None = None
    ) -> tuple[list[Delta], str]:
        """The whole reply of a tool-enabled request as Deltas (the first carrying the
        reply's ``logprobs``), and its finish reason."""
        content, calls = prompted.parse_tool_calls(text, self.forced is not None)
        if self.one_call:
            calls = calls[:1]
        if not calls:
            return [Delta(content, None, finish, logprobs, index)], finish
        out = [Delta(content, None, None, logprobs, index)] if content or logprobs else []
        return [*out, Delta("", calls, "tool_calls", None, index)], "tool_calls"

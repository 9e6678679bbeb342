"""Streamed tool calls: OpenAI sends each call in deltas keyed by ``index``."""

from __future__ import annotations

from typing import Any

import msgspec


class ToolCalls:
    """Folds tool-call deltas into whole calls, in index order."""

    def __init__(self) -> None:
        self._by_index: dict[int, dict[str, Any]] = {}

    def add(self, deltas: list[dict[str, Any]]) -> None:
        for d in deltas:
            i = int(d.get("index", 0))
            cur = self._by_index.setdefault(
                i, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if d.get("id"):
                cur["id"] = d["id"]
            if d.get("type"):
                cur["type"] = d["type"]
            fn = d.get("function") or {}
            if fn.get("name"):
                # Whole in one delta; replaced, so an engine that repeats it stays right.
                cur["function"]["name"] = fn["name"]
            args = fn.get("arguments")
            if isinstance(args, str):
                cur["function"]["arguments"] += args
            elif args is not None:  # an engine that sends an object: keep it as JSON text
                cur["function"]["arguments"] += msgspec.json.encode(args).decode()

    def merged(self) -> list[dict[str, Any]]:
        return [self._by_index[i] for i in sorted(self._by_index)]

    def __bool__(self) -> bool:
        return bool(self._by_index)

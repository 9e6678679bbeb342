"""Tools an agent executor loads in the tests (``--tools-module
tests.agent_tools:slow_effects``): what the demo tools do not cover."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tools import InProcess, Tier, Tool, ToolContext

_SLOW_EFFECT = {
    "type": "object",
    "properties": {
        "book": {"type": "string", "minLength": 1},
        "seconds": {"type": "number", "minimum": 0, "maximum": 60},
    },
    "required": ["book", "seconds"],
    "additionalProperties": False,
}


async def _slow_effect(args: dict[str, Any], ctx: ToolContext) -> Any:
    """The effect (a line in the book, named by the call's key), then a wait
    before the answer: an effect that takes longer than a step may."""
    await asyncio.to_thread(_append, Path(args["book"]), ctx.key)
    await asyncio.sleep(float(args["seconds"]))
    return {"key": ctx.key}


def _append(book: Path, line: str) -> None:
    with book.open("a") as f:
        f.write(line + "\n")


def slow_effects() -> list[Tool]:
    return [
        Tool(
            "slow_effect",
            "Write to a book, then wait.",
            _SLOW_EFFECT,
            InProcess(_slow_effect),
            tier=Tier.SIDE_EFFECTING,
            timeout_s=60.0,
        )
    ]

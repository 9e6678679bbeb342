"""A tool call's arguments as the model sent them: parsed and checked against the
tool's JSON Schema, or a reason the model can read and fix."""

from __future__ import annotations

from typing import Any

import msgspec

from tools.registry import Tool
from tools.wire import decode_json

MAX_ERRORS = 5  # schema violations reported per call


def parse_arguments(tool: Tool, raw: str) -> dict[str, Any] | str:
    """The arguments object, or a readable reason it is not acceptable."""
    text = raw.strip()
    if not text:
        text = "{}"  # some engines send "" for a call without arguments
    try:
        args = decode_json(text)
    except msgspec.DecodeError as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(args, dict):
        return f"expected a JSON object, got {_json_type(args)}"
    errors = tool.validation_errors(args)
    if errors:
        more = len(errors) - MAX_ERRORS
        msg = "; ".join(errors[:MAX_ERRORS])
        return msg + (f"; and {more} more" if more > 0 else "")
    return args


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "null" if v is None else type(v).__name__

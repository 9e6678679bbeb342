"""A request body decoded into its type, or a 400 in the caller's protocol: one
rule for every listener (public, admin, NATS), nesting bound included."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from gateway.errors import BadRequest

T = TypeVar("T")


def decode_body(raw: bytes, kind: type[T]) -> T:
    decoded: T = _decode(raw, kind)
    return decoded


def decode_json(raw: bytes) -> Any:
    """Any JSON value (the caller checks its shape)."""
    return _decode(raw, Any)


def _decode(raw: bytes, kind: Any) -> Any:
    try:
        return msgspec.json.decode(raw or b"null", type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON: {exc}") from None
    except RecursionError:
        # The decoder's recursion bound: a plain-text 500 before.
        raise BadRequest("Invalid JSON: nested too deeply.") from None

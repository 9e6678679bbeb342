"""Structured logs: one JSON object per line, so an operator's collector can
filter by event, request id, tenant, class or worker.

``log_event(log, "refused", request_id=..., tenant=..., cls=..., code=...)`` logs
at info; the fields are identifiers and codes only. Never a prompt or a
completion: no call site passes request text, and ``message`` fields are the
errors' own (engine and gateway errors name limits and codes, not content).
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
FIELDS = "jetserve_fields"  # the LogRecord attribute log_event's fields ride on


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "event" | "msg", ...fields}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, FIELDS, None)
        if fields is not None:
            out.update(fields)
        else:
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _encode(out).decode()


def log_event(log: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One structured event: ``event`` names it, ``fields`` are identifiers and codes."""
    if log.isEnabledFor(level):
        log.log(level, event, extra={FIELDS: {"event": event, **fields}})


def frames_of(exc: BaseException) -> str:
    """Where ``exc`` was raised: its frames (file, line, code), not its message,
    which may quote the request it failed on."""
    return "".join(traceback.format_tb(exc.__traceback__)).rstrip()


def configure(level: str, fmt: str) -> None:
    """The process's logging: JSON lines (``fmt`` "json") or plain text."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # Per-request chatter of the HTTP client libraries is not an operator's event.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))

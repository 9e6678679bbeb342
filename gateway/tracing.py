"""W3C trace context: accept the caller's ``traceparent``, start our span under it
(or a new trace), and hand the result on through NATS to workers and engines.

Only ids cross process boundaries; exporting spans (OpenTelemetry) is optional
and off by default.
"""

from __future__ import annotations

import re
import secrets

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def child_traceparent(incoming: str | None) -> str:
    """Our span's traceparent: same trace id as the caller's, a new span id.
    A missing or malformed header (or an all-zero id) starts a new trace."""
    flags = "01"
    trace_id = None
    if incoming:
        m = _TRACEPARENT.match(incoming.strip().lower())
        if m and m.group(1) != "0" * 32 and m.group(2) != "0" * 16:
            trace_id, flags = m.group(1), m.group(3)
    return f"00-{trace_id or secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"


def trace_id(traceparent: str) -> str:
    return traceparent.split("-")[1] if traceparent.count("-") == 3 else ""

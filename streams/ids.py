"""The one shape of an id that may become a NATS subject token or a KV key.

Run, request, tenant, org and key ids, and tool names (OpenAI's function-name rule,
``^[a-zA-Z0-9_-]{1,64}$``), are all 1 to 64 of ``A-Z a-z 0-9 _ -``: no ``.``, ``*``,
``>`` or whitespace, so an id never reaches another subject or widens a filter.
"""

from __future__ import annotations

import re

SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_safe_id(value: str) -> bool:
    """Whether ``value`` is one safe token (the whole string: a trailing newline is not)."""
    return isinstance(value, str) and SAFE_ID.fullmatch(value) is not None

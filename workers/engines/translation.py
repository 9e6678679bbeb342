"""Translation loss vocabulary: what an adapter does with each request field or behaviour.

An adapter that is not a plain pass-through declares a ``translations`` table (row name ->
:class:`Translated`). The conformance runner reads it, then checks each claim against the
engine's actual behaviour: a field claimed as carried whose effect is missing is a
*silent drop*. Adapters without a table are taken to pass every field through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class FieldStatus(StrEnum):
    PASSED = "passed"  # sent to the engine as is; the engine does the work
    TRANSFORMED = "transformed"  # re-expressed in the dialect (same meaning)
    EMULATED = "emulated"  # the engine cannot do it; the adapter approximates it
    REJECTED = "rejected"  # the adapter refuses the request with a clear EngineRejected


@dataclass(frozen=True, slots=True)
class Translated:
    status: FieldStatus
    note: str = ""


Translations = Mapping[str, Translated]

# Row names shared by adapters and the conformance corpus.
MESSAGES = "messages"
MAX_TOKENS = "max_tokens"
TOOLS = "tools"
RESPONSE_FORMAT = "response_format"
STOP = "stop"
USAGE = "stream_options.include_usage"
CANCELLATION = "cancellation"
ERR_CONTEXT = "error.context_length"
ERR_429 = "error.429"
ERR_5XX = "error.5xx"
ERR_MALFORMED = "error.malformed_chunk"

ROWS = (
    MESSAGES,
    MAX_TOKENS,
    TOOLS,
    RESPONSE_FORMAT,
    STOP,
    USAGE,
    CANCELLATION,
    ERR_CONTEXT,
    ERR_429,
    ERR_5XX,
    ERR_MALFORMED,
)


def declared(adapter: object, row: str) -> Translated:
    """The adapter's claim for `row`; no table (or no entry) means a plain pass-through."""
    table: Translations = getattr(adapter, "translations", {})
    return table.get(row, Translated(FieldStatus.PASSED))

"""One request's timeline, as the client recorded it.

All times are seconds on the load generator's monotonic clock: `scheduled`, `sent`
and `end` from the run start, `ttft`, `chunks` and `e2e` from `sent` (as vLLM's
benchmark measures them: from the moment the request is sent).
"""

from __future__ import annotations

import itertools
from typing import Literal

import msgspec

# ok: a complete stream. rejected: 429 or 503 before any token. timeout: 504/408, or the
# client's own deadline passed. cancelled: the workload hung up on purpose
# (cancel-after). error: any other status, a transport failure, an error event or a
# stream that ended early.
Outcome = Literal["ok", "rejected", "timeout", "cancelled", "error"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "rejected", "timeout", "cancelled", "error")


class Timeline(msgspec.Struct, kw_only=True):
    index: int
    cls: str
    scheduled: float
    sent: float
    end: float
    outcome: Outcome
    status: int = 0  # HTTP status; 0 when none came back
    error: str = ""
    ttft: float | None = None  # first chunk that carries output
    chunks: list[float] = msgspec.field(default_factory=list)  # every output chunk
    e2e: float | None = None
    output_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def lag(self) -> float:
        """How late the generator sent it: the open-loop check."""
        return self.sent - self.scheduled

    @property
    def admitted(self) -> bool:
        return 200 <= self.status < 300

    def output_count(self) -> int:
        """Output tokens: the usage chunk's count, else the output chunks seen."""
        return self.output_tokens if self.output_tokens is not None else len(self.chunks)

    def tpot(self) -> float | None:
        """vLLM: (e2e - ttft) / (output_tokens - 1), for requests with > 1 token."""
        n = self.output_count()
        if self.outcome != "ok" or self.ttft is None or self.e2e is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def itls(self) -> list[float]:
        """vLLM: the gaps between successive output chunks (per chunk, not per token)."""
        c = self.chunks
        return [b - a for a, b in itertools.pairwise(c)]

"""Per-request records and counters served by the /sim introspection routes."""

from __future__ import annotations

from collections import OrderedDict

import msgspec

MAX_RECORDS = 10_000


class RequestRecord(msgspec.Struct, kw_only=True):
    # Wall-clock time.time() floats: tests compare them with their own clocks.
    id: str
    endpoint: str
    status: str = "waiting"  # waiting | running | finished | aborted | failed
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    arrived_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted_at: float | None = None
    finish_reason: str | None = None
    fault: str | None = None
    preemptions: int = 0
    traceparent: str | None = None  # as received: shows the trace crossed the gateway


class RequestLog:
    """The most recent MAX_RECORDS records; a reused request id replaces the old record."""

    def __init__(self, limit: int = MAX_RECORDS) -> None:
        self._limit = limit
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()

    def add(self, rec: RequestRecord) -> None:
        self._records.pop(rec.id, None)
        self._records[rec.id] = rec
        while len(self._records) > self._limit:
            self._records.popitem(last=False)

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def __len__(self) -> int:
        return len(self._records)


class Counters(msgspec.Struct, kw_only=True):
    requests: int = 0  # every generation/embedding request that reached a route
    started: int = 0  # entered the engine
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    embeddings: int = 0
    faults: dict[str, int] = msgspec.field(default_factory=dict)
    scripted: int = 0

"""Refusal records, bounded per tenant.

A request refused before any hold (over a budget or a rate limit) is recorded
in the ledger, so its tenant can see what was refused and why. The refusal
costs its sender nothing, though, and its record costs the fleet three stored
writes (the outbox, the ledger, the outbox's delete) and half a KiB kept for
90 days: a key that sends 4,000 requests into its rate limit made 3,999
records. So each tenant's refusals are recorded one by one while a token
bucket per tenant (on this gateway) allows, and past it they are counted:
each window then ends in one record per kind of refusal (key, op, class,
policy, outcome) whose ``count`` says how many refusals it stands for. Every
refusal is still in the books, in a record or in a count.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from streams.request_ledger import LedgerRecord

# A summary's request id: never a request's (those are bare hex), so a record is
# told a summary by its id as well as by its ``count``.
SUMMARY_PREFIX = "refusals_"
# Tenants whose buckets are kept; the least recently refused goes first (its
# bucket starts full again: at most one more burst of records).
MAX_TENANTS = 10_000

_Kind = tuple[str, str, str, str, str, str, str, int]


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class _Summary:
    first: LedgerRecord  # the first refusal counted: the summary's columns
    count: int
    mixed_model: bool = False
    mixed_route: bool = False


class RefusalRecords:
    """Which refusals get a record each, and the summaries of the rest.

    ``per_s`` records a second per tenant after a burst of ``burst``; the
    counted rest is summarised once ``window_s`` has passed since the first of
    them (``due``), or at shutdown (``drain``)."""

    def __init__(
        self,
        per_s: float,
        burst: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_s = per_s
        self._burst = float(burst)
        self._window_s = window_s
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._counted: dict[_Kind, _Summary] = {}
        self._since: float | None = None  # when the oldest counted refusal came

    def take(self, record: LedgerRecord) -> bool:
        """Whether ``record`` is written as itself; False: it is counted into
        the next summary of its kind."""
        now = self._clock()
        bucket = self._buckets.pop(record.tenant, None)
        if bucket is None:
            bucket = _Bucket(self._burst, now)
        else:
            bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) * self._per_s)
            bucket.at = now
        self._buckets[record.tenant] = bucket  # most recent last
        while len(self._buckets) > MAX_TENANTS:
            self._buckets.popitem(last=False)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        kind = (
            record.tenant, record.org, record.key_id, record.op, record.cls,
            record.policy, record.outcome, record.status,
        )  # fmt: skip
        summary = self._counted.get(kind)
        if summary is None:
            self._counted[kind] = _Summary(record, 1)
        else:
            summary.count += 1
            summary.mixed_model |= summary.first.model != record.model
            summary.mixed_route |= summary.first.route != record.route
        if self._since is None:
            self._since = now
        return False

    def due(self) -> list[LedgerRecord]:
        """The summaries, once the window of the oldest counted refusal is over."""
        if self._since is None or self._clock() - self._since < self._window_s:
            return []
        return self.drain()

    def drain(self) -> list[LedgerRecord]:
        """Every summary now (shutdown), the counts started again."""
        counted, self._counted, self._since = self._counted, {}, None
        return [_summary(s) for s in counted.values()]


def _summary(s: _Summary) -> LedgerRecord:
    """One record for ``s.count`` refusals of one kind: the first one's columns
    (its ``created`` starts the span), a model or route only where all shared it."""
    return msgspec.structs.replace(
        s.first,
        request_id=f"{SUMMARY_PREFIX}{uuid.uuid4().hex}",
        count=s.count,
        model="" if s.mixed_model else s.first.model,
        route="" if s.mixed_route else s.first.route,
        route_revision=0 if s.mixed_route else s.first.route_revision,
        idempotency_key_hash="",
    )

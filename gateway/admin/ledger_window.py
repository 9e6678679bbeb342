"""The last minutes of the request ledger, kept in memory by the gateway that
holds the rollout guard's lease (gateway/admin/rollout_guard.py).

The guard judges each canary over its window every tick, and the evidence
watch compares each route's recent figures with its evidence. Reading the
window from the ledger each time would scan every record of the window, for
every tenant and route, every tick: 60,000 records every 2 s at 1,000 req/s
and a 60 s window. Instead one follower (:meth:`LedgerReader.follow`) reads
each record once, when it is appended. The window starts with one scan back
to its horizon (when the lease is taken, or the horizon grows) and keeps, per
route, only what the analysis reads (:class:`Sample`, about a tenth of a
decoded record), for at most ``horizon_s``.
"""

from __future__ import annotations

import sys
import time
from collections import deque

import msgspec

from gateway.admin.rollout_analysis import ended
from gateway.tenancy.request_ledger import LedgerFollow, LedgerFollowLost, LedgerReader
from streams.request_ledger import LedgerRecord


class Sample(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What the arms' and the SLO figures read of one ledger record
    (gateway/admin/rollout_analysis.py ``Sampled``)."""

    created: float
    route: str
    route_revision: int
    rollout_arm: str
    shadow: bool
    policy: str
    status: int
    first_token_ms: float | None
    duration_ms: float = 0.0


def sample(r: LedgerRecord) -> Sample:
    return Sample(
        created=r.created,
        route=sys.intern(r.route),  # few distinct values: one string each
        route_revision=r.route_revision,
        rollout_arm=sys.intern(r.rollout_arm),
        shadow=r.shadow,
        policy=sys.intern(r.policy),
        status=r.status,
        first_token_ms=r.first_token_ms,
        duration_ms=r.duration_ms,
    )


class LedgerWindow:
    """Per route, the samples of the last ``horizon_s`` seconds (by when each
    request ended: rollout_analysis.ended)."""

    def __init__(self, reader: LedgerReader) -> None:
        self.reader = reader
        self.horizon_s = 0.0
        self._follow: LedgerFollow | None = None
        self._routes: dict[str, deque[Sample]] = {}
        self.records_read = 0  # since the window (re)started: tests and metrics read it

    def __len__(self) -> int:
        return sum(map(len, self._routes.values()))

    async def advance(self, horizon_s: float, now: float | None = None) -> None:
        """Read what was appended since the last call; forget what is older than
        the horizon. A horizon longer than the window's (a new guard, a longer
        window) starts it again with one scan back to the new horizon."""
        at = time.time() if now is None else now
        if horizon_s > self.horizon_s:
            await self.aclose()
            self.horizon_s = horizon_s
        if self._follow is None:
            self._routes.clear()
            self.records_read = 0
            self._follow = await self.reader.follow(since=at - self.horizon_s)
        try:
            records = await self._follow.poll()
        except LedgerFollowLost:
            await self.aclose()  # the next call starts again from the horizon
            raise
        self.records_read += len(records)
        for r in records:
            if r.route:
                self._routes.setdefault(r.route, deque()).append(sample(r))
        cutoff = at - self.horizon_s
        for name in list(self._routes):
            kept = self._routes[name]
            while kept and ended(kept[0]) < cutoff:
                kept.popleft()
            if not kept:
                del self._routes[name]

    def samples(self, route: str, revision: int) -> list[Sample]:
        return [s for s in self._routes.get(route, ()) if s.route_revision == revision]

    async def aclose(self) -> None:
        if self._follow is not None:
            follow, self._follow = self._follow, None
            await follow.aclose()

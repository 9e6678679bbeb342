"""A rollout's arms compared, from the request ledger (docs/rollout.md).

The ledger is the fleet's record of every request, whichever gateway took it,
so the comparison is fleet-wide: records of the route at its current revision
that carry an arm (``rollout_arm`` stable|canary; refusals left out: no arm
served them). Per arm: requests, errors (a 5xx the client saw), the error rate
and the first-token p95. The guard (``rollout.guard``) compares the arms over
its window once each arm has ``min_samples`` requests there:

- error ratio: the canary's error rate over the stable arm's, each floored at
  :data:`ERROR_RATE_FLOOR` (so two clean arms compare as 1.0, and a stable arm
  with no errors does not make one canary error an infinite ratio);
- first-token p95 ratio: the canary's p95 over the stable arm's.

Either ratio above its threshold fails the canary. :func:`analyse` is pure;
:func:`read_records` reads the ledger.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from gateway.tenancy.request_ledger import LedgerReader
from streams.request_ledger import LedgerRecord
from streams.routes import RouteRecord

ERROR_RATE_FLOOR = 0.01
ARMS = ("stable", "canary")


class Sampled(Protocol):
    """What the arms' figures read of a record: a :class:`LedgerRecord`, or the
    rollout guard's in-memory :class:`gateway.admin.ledger_window.Sample`."""

    @property
    def created(self) -> float: ...
    @property
    def route(self) -> str: ...
    @property
    def route_revision(self) -> int: ...
    @property
    def rollout_arm(self) -> str: ...
    @property
    def shadow(self) -> bool: ...
    @property
    def policy(self) -> str: ...
    @property
    def status(self) -> int: ...
    @property
    def first_token_ms(self) -> float | None: ...
    @property
    def duration_ms(self) -> float: ...


def ended(r: Sampled) -> float:
    """When the request ended (its record is written then): what a window of the
    last minutes counts by. By ``created``, a canary whose requests ran to a
    deadline as long as the window (60 s each, by default) was never in it: the
    guard saw 0 canary requests and judged nothing while they all timed out."""
    return r.created + r.duration_ms / 1000


class ArmFigures(msgspec.Struct, frozen=True, kw_only=True):
    requests: int = 0
    errors: int = 0
    error_rate: float = 0.0
    ttft_p95_ms: float | None = None  # None: no request of the arm had a first token


class Guard(msgspec.Struct, frozen=True, kw_only=True):
    """The guard's figures over its window, against its thresholds."""

    window_s: float
    min_samples: int
    stable: ArmFigures
    canary: ArmFigures
    error_ratio: float | None  # None: too few samples to compare
    max_error_ratio: float
    ttft_p95_ratio: float | None
    max_ttft_p95_ratio: float


class ShadowSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Shadow copies against the requests they copied (gateway/inference/shadow.py).
    Ratios are shadow over served, medians of the pairs; None: no pair to compare.
    Exact match and JSON validity are the gateway's verdicts (gateway/inference/shadow.py)."""

    copies: int = 0
    paired: int = 0  # copies whose served request's record is in too
    errors: int = 0  # copies that ended in a 5xx
    error_class_mismatches: int = 0  # served ok and shadow not, or the other way, or codes differ
    ttft_ratio_p50: float | None = None
    e2e_ratio_p50: float | None = None
    output_tokens_ratio_p50: float | None = None
    exact_compared: int = 0  # copies compared at temperature 0 (both answered)
    exact_matches: int = 0
    json_checked: int = 0  # copies of requests that asked for JSON
    json_valid: int = 0
    # The served answers of those requests, checked the same way: a shadow's
    # JSON rate means little without the stable arm's beside it.
    served_json_checked: int = 0
    served_json_valid: int = 0


class Analysis(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    revision: int
    since: float  # when the revision took effect (its updated_at)
    arms: dict[str, ArmFigures]  # since the revision took effect
    shares: dict[str, float]
    guard: Guard | None  # None: the revision has no canary
    # "no_canary" | "collecting" (fewer than min_samples in an arm) | "healthy" | "failing"
    decision: str
    reason: str
    shadow: ShadowSummary | None = None  # None: the revision has no shadow


def p95(values: list[float]) -> float | None:
    """Nearest rank: the smallest value with at least 95% of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def figures(records: Iterable[Sampled]) -> ArmFigures:
    n = errors = 0
    ttft: list[float] = []
    for r in records:
        n += 1
        errors += r.status >= 500
        if r.first_token_ms is not None:
            ttft.append(r.first_token_ms)
    return ArmFigures(
        requests=n, errors=errors, error_rate=errors / n if n else 0.0, ttft_p95_ms=p95(ttft)
    )


def p50(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _error_class(r: LedgerRecord) -> str:
    return "ok" if r.status < 400 else r.outcome


def shadow_summary(records: Iterable[LedgerRecord], route: str, revision: int) -> ShadowSummary:
    mine = [r for r in records if r.route == route and r.route_revision == revision]
    served = {r.request_id: r for r in mine if not r.shadow}
    copies = [r for r in mine if r.shadow]
    ttft: list[float] = []
    e2e: list[float] = []
    length: list[float] = []
    paired = mismatches = 0
    for copy in copies:
        real = served.get(copy.shadow_of)
        if real is None:
            continue
        paired += 1
        mismatches += _error_class(real) != _error_class(copy)
        if real.first_token_ms and copy.first_token_ms is not None:
            ttft.append(copy.first_token_ms / real.first_token_ms)
        if real.duration_ms > 0:
            e2e.append(copy.duration_ms / real.duration_ms)
        if real.usage.completion_tokens > 0:
            length.append(copy.usage.completion_tokens / real.usage.completion_tokens)
    exact = [c.shadow_exact_match for c in copies if c.shadow_exact_match is not None]
    json_ok = [c.shadow_json_valid for c in copies if c.shadow_json_valid is not None]
    served_ok = [
        c.shadow_served_json_valid for c in copies if c.shadow_served_json_valid is not None
    ]
    return ShadowSummary(
        exact_compared=len(exact),
        exact_matches=sum(exact),
        json_checked=len(json_ok),
        json_valid=sum(json_ok),
        served_json_checked=len(served_ok),
        served_json_valid=sum(served_ok),
        copies=len(copies),
        paired=paired,
        errors=sum(c.status >= 500 for c in copies),
        error_class_mismatches=mismatches,
        ttft_ratio_p50=p50(ttft),
        e2e_ratio_p50=p50(e2e),
        output_tokens_ratio_p50=p50(length),
    )


def in_arms(records: Iterable[Sampled], route: str, revision: int) -> list[Sampled]:
    """The records that count: the route's, at ``revision``, on an arm; served, or
    refused by the arm itself (a 5xx after the split: its deployment has no pool,
    or no worker holds the adapter asked for). A refusal of the caller (its
    budget, its rate, a bad body: 4xx) says nothing of the arm. Before, every
    refusal was left out, and a canary that refused all its share looked like
    one still collecting samples."""
    return [
        r
        for r in records
        if r.route == route
        and r.route_revision == revision
        and r.rollout_arm in ARMS
        and not r.shadow
        and (not r.policy.startswith("rejected") or r.status >= 500)
    ]


def analyse(
    record: RouteRecord,
    records: Sequence[Sampled],
    now: float,
    shadow: ShadowSummary | None = None,
) -> Analysis:
    """The arms in ``records``, the guard over its window, and the decision;
    ``shadow``, the shadow comparison, is passed through."""
    name, revision = record.contract.name, record.revision
    mine = in_arms(records, name, revision)
    arms = {arm: figures(r for r in mine if r.rollout_arm == arm) for arm in ARMS}
    total = sum(a.requests for a in arms.values())
    shares = {arm: (arms[arm].requests / total if total else 0.0) for arm in ARMS}
    rollout = record.contract.rollout
    if rollout is None or rollout.canary is None:
        return Analysis(
            route=name,
            revision=revision,
            since=record.updated_at,
            arms=arms,
            shares=shares,
            guard=None,
            decision="no_canary",
            reason=f"revision {revision} of '{name}' has no canary",
            shadow=shadow,
        )
    g = rollout.guard
    recent = [r for r in mine if ended(r) >= now - g.window_s]
    stable = figures(r for r in recent if r.rollout_arm == "stable")
    canary = figures(r for r in recent if r.rollout_arm == "canary")
    enough = min(stable.requests, canary.requests) >= g.min_samples
    error_ratio = ttft_ratio = None
    if enough:
        error_ratio = max(canary.error_rate, ERROR_RATE_FLOOR) / max(
            stable.error_rate, ERROR_RATE_FLOOR
        )
        if canary.ttft_p95_ms is not None and stable.ttft_p95_ms:
            ttft_ratio = canary.ttft_p95_ms / stable.ttft_p95_ms
    guard = Guard(
        window_s=g.window_s,
        min_samples=g.min_samples,
        stable=stable,
        canary=canary,
        error_ratio=error_ratio,
        max_error_ratio=g.max_error_ratio,
        ttft_p95_ratio=ttft_ratio,
        max_ttft_p95_ratio=g.max_ttft_p95_ratio,
    )
    decision, reason = _decide(guard)
    return Analysis(
        route=name,
        revision=revision,
        since=record.updated_at,
        arms=arms,
        shares=shares,
        guard=guard,
        decision=decision,
        reason=reason,
        shadow=shadow,
    )


def _decide(g: Guard) -> tuple[str, str]:
    if g.error_ratio is None:
        return "collecting", (
            f"{g.canary.requests} canary and {g.stable.requests} stable requests in the last "
            f"{g.window_s:g}s; the guard compares from {g.min_samples} each"
        )
    if g.error_ratio > g.max_error_ratio:
        return "failing", (
            f"canary error rate {g.canary.error_rate:.1%} ({g.canary.errors}/{g.canary.requests})"
            f" vs stable {g.stable.error_rate:.1%} ({g.stable.errors}/{g.stable.requests}):"
            f" ratio {g.error_ratio:.2f} > {g.max_error_ratio:g}"
        )
    if g.ttft_p95_ratio is not None and g.ttft_p95_ratio > g.max_ttft_p95_ratio:
        return "failing", (
            f"canary first-token p95 {g.canary.ttft_p95_ms:.0f} ms vs stable "
            f"{g.stable.ttft_p95_ms:.0f} ms: ratio {g.ttft_p95_ratio:.2f} > "
            f"{g.max_ttft_p95_ratio:g}"
        )
    ttft = f"{g.ttft_p95_ratio:.2f}" if g.ttft_p95_ratio is not None else "n/a"
    return "healthy", (
        f"error ratio {g.error_ratio:.2f} <= {g.max_error_ratio:g}, first-token p95 ratio "
        f"{ttft} <= {g.max_ttft_p95_ratio:g}"
    )


async def read_records(
    reader: LedgerReader, record: RouteRecord, since: float | None = None
) -> list[LedgerRecord]:
    """The route's records at its revision (every tenant's), ended since
    ``since`` (default: when the revision took effect, less the clock skew
    the ledger allows between gateways): created up to a deadline before it."""
    name, revision = record.contract.name, record.revision
    start = record.updated_at - reader.topo.clock_skew_s
    ran = record.contract.deadline_s
    out: list[LedgerRecord] = []
    async for r in reader.query_all(since=max(start, (since or start) - ran)):
        if r.route == name and r.route_revision == revision:
            out.append(r)
    return out


async def analyse_now(reader: LedgerReader, record: RouteRecord) -> Analysis:
    """Everything since the revision took effect, shadows compared (a status read)."""
    records = await read_records(reader, record)
    rollout = record.contract.rollout
    shadow = None
    if rollout is not None and rollout.shadow is not None:
        shadow = shadow_summary(records, record.contract.name, record.revision)
    return analyse(record, records, time.time(), shadow)

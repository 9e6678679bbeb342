"""The SLO-regression trigger of a revision's evidence (docs/rollout.md): the
route's production figures now, from the request ledger, against the figures
its evidence was recorded with.

The evidenced figures (the *baseline*) are, in this order:

- ``slo``: measured from the ledger when an operator attached evidence with
  ``measure_slo`` (the route's requests at that revision over the guard's
  window);
- the guard's final figures (``guard.figures.stable``), written when the
  guard rolled a canary back: the stable arm is what the route was judged
  good at.

The route's recent figures are its requests at the *current* revision over the
guard's window (``rollout.guard`` of the current contract, its defaults when the
contract has none): every tenant's, shadows and refusals left out, an error a
5xx the client saw. Once there are ``min_samples`` of them, they are compared
with the guard's thresholds, as the guard compares a canary with its stable
arm: the error rate ratio (each rate floored at 1%) above ``max_error_ratio``,
or the first-token p95 ratio above ``max_ttft_p95_ratio``, fires
``slo_regression``. :func:`regression` is pure; :func:`slo_trigger` reads the
ledger.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

from gateway.admin.rollout_analysis import (
    ERROR_RATE_FLOOR,
    ArmFigures,
    Sampled,
    ended,
    figures,
    read_records,
)
from gateway.tenancy.request_ledger import LedgerReader
from streams.evidence import Evidence, Trigger
from streams.routes import GuardPolicy, RouteRecord


def policy_of(record: RouteRecord) -> GuardPolicy:
    """The thresholds: the contract's guard, else the guard's defaults."""
    rollout = record.contract.rollout
    return rollout.guard if rollout is not None else GuardPolicy()


def production(records: Iterable[Sampled], record: RouteRecord, since: float) -> ArmFigures:
    """The route's figures at ``record``'s revision from ``since``."""
    name, revision = record.contract.name, record.revision
    return figures(
        r
        for r in records
        if r.route == name
        and r.route_revision == revision
        and ended(r) >= since
        and not r.shadow
        and not r.policy.startswith("rejected")
    )


async def measure(reader: LedgerReader, record: RouteRecord, now: float) -> ArmFigures:
    """The route's figures at ``record``'s revision over its guard's window."""
    since = now - policy_of(record).window_s
    return production(await read_records(reader, record, since), record, since)


def slo_of(figures_: ArmFigures, record: RouteRecord, now: float) -> dict[str, Any]:
    """The evidence's ``slo`` entry for figures measured at ``record``'s revision."""
    return {
        **msgspec.to_builtins(figures_),
        "revision": record.revision,
        "window_s": policy_of(record).window_s,
        "measured_at": now,
    }


def baseline(evidence: Evidence) -> tuple[str, ArmFigures] | None:
    """Where the evidenced figures come from and what they are; None: none recorded."""
    try:
        if evidence.slo:
            return "measured", msgspec.convert(_figures_only(evidence.slo), ArmFigures)
        stable = evidence.guard.get("figures", {}).get("stable") if evidence.guard else None
        if stable:
            return "the guard's stable arm", msgspec.convert(_figures_only(stable), ArmFigures)
    except (msgspec.ValidationError, AttributeError, TypeError):
        return None  # written by hand in some other shape: no baseline to compare
    return None


def _figures_only(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: raw[k] for k in ("requests", "errors", "error_rate", "ttft_p95_ms") if k in raw}


def regression(
    base: ArmFigures, now: ArmFigures, policy: GuardPolicy, source: str = "evidenced"
) -> Trigger | None:
    """``slo_regression`` when ``now`` is worse than ``base`` past the thresholds."""
    if now.requests < policy.min_samples or base.requests == 0:
        return None
    ratio = max(now.error_rate, ERROR_RATE_FLOOR) / max(base.error_rate, ERROR_RATE_FLOOR)
    if ratio > policy.max_error_ratio:
        return Trigger(
            kind="slo_regression",
            detail=(
                f"error rate {now.error_rate:.1%} ({now.errors}/{now.requests}) vs {source}"
                f" {base.error_rate:.1%} ({base.errors}/{base.requests}):"
                f" ratio {ratio:.2f} > {policy.max_error_ratio:g}"
            ),
        )
    if now.ttft_p95_ms is not None and base.ttft_p95_ms:
        ttft = now.ttft_p95_ms / base.ttft_p95_ms
        if ttft > policy.max_ttft_p95_ratio:
            return Trigger(
                kind="slo_regression",
                detail=(
                    f"first-token p95 {now.ttft_p95_ms:.0f} ms vs {source}"
                    f" {base.ttft_p95_ms:.0f} ms: ratio {ttft:.2f} > {policy.max_ttft_p95_ratio:g}"
                ),
            )
    return None


async def slo_trigger(
    reader: LedgerReader, evidence: Evidence, current: RouteRecord, now: float | None = None
) -> Trigger | None:
    """The trigger against the route's production figures now, if it fires."""
    found = baseline(evidence)
    if found is None:
        return None
    source, base = found
    at = time.time() if now is None else now
    recent = await measure(reader, current, at)
    return regression(base, recent, policy_of(current), f"{source} r{evidence.revision}")

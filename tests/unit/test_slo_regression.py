"""The SLO-regression trigger (gateway/admin/slo_regression.py): the baseline an
evidence record carries, and when production figures past the guard's
thresholds fire it."""

from __future__ import annotations

import msgspec

from gateway.admin.rollout_analysis import ArmFigures
from gateway.admin.slo_regression import baseline, production, regression, slo_of
from streams.evidence import Evidence, decode_evidence, encode_evidence, new_evidence
from streams.request_ledger import LedgerRecord
from streams.routes import GuardPolicy
from streams.wire import Usage
from tests.unit.test_evidence import NOW, record

POLICY = GuardPolicy(min_samples=5, window_s=60.0, max_error_ratio=2.0, max_ttft_p95_ratio=1.5)
GOOD = ArmFigures(requests=20, errors=0, error_rate=0.0, ttft_p95_ms=100.0)


def test_an_older_record_without_slo_still_decodes_and_has_no_baseline() -> None:
    ev = new_evidence(record(), "p1", NOW)
    raw = msgspec.json.decode(encode_evidence(ev))
    del raw["slo"]
    old = decode_evidence(msgspec.json.encode(raw))
    assert old.slo == {}
    assert baseline(old) is None


def test_the_measured_figures_are_the_baseline_before_the_guards() -> None:
    ev = new_evidence(record(), "p1", NOW)
    guard = {"figures": {"stable": msgspec.to_builtins(GOOD), "canary": {}}, "decision": "x"}
    from_guard = msgspec.structs.replace(ev, guard=guard)
    assert baseline(from_guard) == ("the guard's stable arm", GOOD)
    measured = ArmFigures(requests=8, errors=1, error_rate=0.125, ttft_p95_ms=50.0)
    both = msgspec.structs.replace(from_guard, slo=slo_of(measured, record(), NOW))
    assert both.slo["revision"] == 1
    assert baseline(both) == ("measured", measured)
    odd: Evidence = msgspec.structs.replace(ev, slo={"requests": "many"})
    assert baseline(odd) is None  # a hand-written shape: nothing to compare


def test_an_error_rate_past_the_ratio_fires() -> None:
    bad = ArmFigures(requests=10, errors=5, error_rate=0.5, ttft_p95_ms=100.0)
    fired = regression(GOOD, bad, POLICY, "measured r1")
    assert fired is not None
    assert fired.kind == "slo_regression"
    assert fired.detail == ("error rate 50.0% (5/10) vs measured r1 0.0% (0/20): ratio 50.00 > 2")
    # Both floored at 1%: one error in 100 against none is no regression.
    slight = ArmFigures(requests=100, errors=1, error_rate=0.01, ttft_p95_ms=100.0)
    assert regression(GOOD, slight, POLICY) is None


def test_a_slow_first_token_past_the_ratio_fires() -> None:
    slow = ArmFigures(requests=10, errors=0, error_rate=0.0, ttft_p95_ms=151.0)
    fired = regression(GOOD, slow, POLICY, "measured r1")
    assert fired is not None
    assert fired.detail == "first-token p95 151 ms vs measured r1 100 ms: ratio 1.51 > 1.5"
    assert regression(GOOD, msgspec.structs.replace(slow, ttft_p95_ms=150.0), POLICY) is None


def test_too_few_samples_or_an_empty_baseline_never_fire() -> None:
    bad = ArmFigures(requests=4, errors=4, error_rate=1.0, ttft_p95_ms=None)
    assert regression(GOOD, bad, POLICY) is None
    empty = ArmFigures()
    assert regression(empty, msgspec.structs.replace(bad, requests=50), POLICY) is None


def _rec(i: int, *, status: int = 200, revision: int = 1, **over: object) -> LedgerRecord:
    fields: dict[str, object] = {
        "request_id": f"q{i}", "tenant": "t", "org": "t", "key_id": "k", "op": "chat",
        "cls": "interactive", "model": "r", "attempts": 1, "policy": "admitted",
        "usage": Usage(1, 1), "price_version": "p1", "charge_micros": 1,
        "reserved_micros": 1, "outcome": "stop", "status": status, "created": NOW + i,
        "duration_ms": 1.0, "gateway": "g", "route": "r", "route_revision": revision,
        "first_token_ms": 10.0 * i,
    }  # fmt: skip
    fields.update(over)
    return msgspec.convert(fields, LedgerRecord, from_attributes=False)


def test_production_counts_the_revisions_served_requests_in_the_window_only() -> None:
    records = [
        _rec(1),
        _rec(2, status=503),
        _rec(3, revision=2),  # another revision
        _rec(4, shadow=True),  # a shadow copy: the operator's
        _rec(5, policy="rejected:budget", status=429),
        _rec(-100),  # before the window
    ]
    got = production(records, record(), since=NOW)
    assert (got.requests, got.errors, got.ttft_p95_ms) == (2, 1, 20.0)

"""The rollout analysis (gateway/admin/rollout_analysis.py): which ledger
records count, the guard's figures and ratios, and the decision; and the CLI's
status text."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.admin.rollout_analysis import ERROR_RATE_FLOOR, analyse, p95, shadow_summary
from gateway.inference import rollout, shadow
from jetserve.commands.routes import format_status
from streams.request_ledger import LedgerRecord
from streams.routes import RouteRecord, ShadowPolicy, contract_from_builtins, fingerprints
from streams.wire import InferenceRequest, Op, Usage

NOW = 10_000.0

KEY = rollout.arms_key(b"s" * 32)


def route(revision: int = 2, **guard: Any) -> RouteRecord:
    body: dict[str, Any] = {
        "name": "r",
        "candidates": [
            {"name": "old", "adapter": "openai", "engine": "e", "model": "m"},
            {"name": "new", "adapter": "openai", "engine": "e", "model": "m"},
        ],
        "rollout": {
            "canary": {"candidate": "new", "share": 0.5},
            "guard": {"min_samples": 4, "window_s": 60, **guard},
        },
    }
    c = contract_from_builtins(body)
    return RouteRecord(
        contract=c,
        revision=revision,
        updated_at=NOW - 600,
        updated_by="t",
        fingerprints=fingerprints(c),
    )


def rec(arm: str, status: int = 200, ttft: float | None = 100.0, **over: Any) -> LedgerRecord:
    fields: dict[str, Any] = {
        "request_id": "x",
        "tenant": "t",
        "org": "t",
        "key_id": "k",
        "op": "chat",
        "cls": "interactive",
        "model": "r",
        "route": "r",
        "route_revision": 2,
        "attempts": 1,
        "policy": "admitted",
        "usage": Usage(),
        "price_version": "v",
        "charge_micros": 0,
        "reserved_micros": 0,
        "outcome": "stop",
        "status": status,
        "created": NOW - 1,
        "first_token_ms": ttft,
        "duration_ms": 1.0,
        "gateway": "g",
        "rollout_arm": arm,
    }
    fields.update(over)
    return LedgerRecord(**fields)


def test_p95_is_the_nearest_rank() -> None:
    assert p95([]) is None
    assert p95([5.0]) == 5.0
    assert p95([float(v) for v in range(1, 101)]) == 95.0
    assert p95([float(v) for v in range(1, 21)]) == 19.0


def test_too_few_samples_is_collecting() -> None:
    records = [rec("stable")] * 10 + [rec("canary", status=503)] * 3
    a = analyse(route(), records, NOW)
    assert a.decision == "collecting"
    assert a.guard is not None
    assert a.guard.error_ratio is None
    assert a.arms["canary"].errors == 3
    assert a.shares == pytest.approx({"stable": 10 / 13, "canary": 3 / 13})


def test_two_clean_arms_are_healthy_at_ratio_one() -> None:
    a = analyse(route(), [rec("stable")] * 8 + [rec("canary")] * 4, NOW)
    assert a.decision == "healthy", a.reason
    assert a.guard is not None
    assert a.guard.error_ratio == 1.0
    assert a.guard.ttft_p95_ratio == 1.0


def test_a_failing_canary_fails_on_errors_with_the_floor() -> None:
    records = [rec("stable")] * 100 + [rec("canary", status=503)] * 2 + [rec("canary")] * 8
    a = analyse(route(), records, NOW)
    assert a.decision == "failing"
    assert a.guard is not None
    assert a.guard.error_ratio == pytest.approx(0.2 / ERROR_RATE_FLOOR)
    assert "error rate 20.0% (2/10)" in a.reason
    # One error in a hundred against a clean stable arm stays inside a ratio of 2.
    calm = [rec("stable")] * 100 + [rec("canary", status=500)] + [rec("canary")] * 99
    assert analyse(route(), calm, NOW).decision == "healthy"


def test_a_slow_canary_fails_on_first_token_p95() -> None:
    records = [rec("stable", ttft=100.0)] * 10 + [rec("canary", ttft=400.0)] * 10
    a = analyse(route(), records, NOW)
    assert a.decision == "failing"
    assert a.guard is not None
    assert a.guard.ttft_p95_ratio == 4.0
    assert "first-token p95 400 ms vs stable 100 ms" in a.reason
    assert analyse(route(max_ttft_p95_ratio=5.0), records, NOW).decision == "healthy"


def test_only_this_revisions_served_arm_records_in_the_window_count() -> None:
    bad = rec("canary", status=503)
    noise = [
        msgspec.structs.replace(bad, route_revision=1),
        msgspec.structs.replace(bad, route="other"),
        msgspec.structs.replace(bad, rollout_arm=""),
        msgspec.structs.replace(bad, policy="rejected:budget", status=429),
        msgspec.structs.replace(bad, created=NOW - 120),  # so far, not in the window
    ]
    a = analyse(route(), [rec("stable")] * 4 + [rec("canary")] * 4 + noise, NOW)
    assert a.decision == "healthy", a.reason
    assert a.arms["canary"].requests == 5
    assert a.guard is not None
    assert a.guard.canary.requests == 4


def test_requests_that_ran_to_their_deadline_count_when_they_ended() -> None:
    """A record is written when its request ends; the window counted by when it
    began. A canary whose requests all ran to a deadline as long as the window
    (60 s each, the defaults) was never in it: 0 canary requests, "collecting"
    for ever, while every one of them timed out."""
    late = rec("canary", status=504, ttft=None, created=NOW - 60.5, duration_ms=60_000.0)
    a = analyse(route(), [rec("stable")] * 20 + [late] * 20, NOW)
    assert a.decision == "failing", a.reason
    assert a.guard is not None
    assert a.guard.canary.requests == 20
    # Begun inside the window or not, one that ended before it is out.
    gone = rec("canary", status=504, ttft=None, created=NOW - 200, duration_ms=60_000.0)
    out = analyse(route(), [rec("stable")] * 20 + [gone] * 20, NOW)
    assert out.decision == "collecting", out.reason


def test_a_canary_that_refuses_its_share_fails() -> None:
    # Refused after the split by the arm itself (its pool missing, no worker with
    # the adapter: 503): the canary's failures, though nothing was served. They
    # used to be left out with every refusal, and the canary read "collecting".
    refused = rec("canary", status=503)
    refused = msgspec.structs.replace(refused, policy="rejected:adapter_unavailable")
    a = analyse(route(), [rec("stable")] * 10 + [refused] * 10, NOW)
    assert a.decision == "failing", a.reason
    assert a.arms["canary"].errors == 10


def test_a_revision_without_a_canary_says_so() -> None:
    plain = route()
    plain = msgspec.structs.replace(
        plain, contract=msgspec.structs.replace(plain.contract, rollout=None)
    )
    a = analyse(plain, [], NOW)
    assert a.decision == "no_canary"
    assert a.guard is None


def test_the_status_text() -> None:
    r = route()
    records = [rec("stable")] * 100 + [rec("canary", status=503)] * 2 + [rec("canary")] * 8
    body = msgspec.to_builtins(analyse(r, records, NOW))
    body["rollout"] = msgspec.to_builtins(r.contract.rollout)
    body["rollback"] = None
    text = format_status(body)
    assert "canary: new at 50.0% of all classes, all tenants" in text
    assert "  canary       10 requests    9.1%  errors 2" in text
    assert "error ratio 20.00 (max 2)" in text
    assert text.splitlines()[-1].startswith("decision: failing: canary error rate 20.0%")


def test_shadow_copies_pair_with_the_requests_they_copied() -> None:
    r = route()
    assert r.contract.rollout is not None
    with_shadow = msgspec.structs.replace(
        r.contract,
        rollout=msgspec.structs.replace(
            r.contract.rollout, shadow=ShadowPolicy(candidate="new", share=1.0)
        ),
    )
    r = msgspec.structs.replace(r, contract=with_shadow)
    usage = Usage(prompt_tokens=5, completion_tokens=10)
    served = [
        rec("", request_id=f"q{n}", ttft=100.0, duration_ms=200.0, usage=usage) for n in range(3)
    ]
    copies = [
        rec(
            "",
            request_id=f"q{n}-shadow",
            shadow=True,
            shadow_of=f"q{n}",
            tenant="jetserve-shadow",
            ttft=300.0,
            duration_ms=400.0,
            usage=Usage(prompt_tokens=5, completion_tokens=5),
            shadow_exact_match=n == 0,
            shadow_json_valid=True,
            shadow_served_json_valid=n == 1,
        )
        for n in range(2)
    ]
    failed = rec("", request_id="q2-shadow", shadow=True, shadow_of="q2", status=503,
                 outcome="engine_unavailable", ttft=None)  # fmt: skip
    orphan = rec("", request_id="zz-shadow", shadow=True, shadow_of="zz")
    records = [*served, *copies, failed, orphan]
    a = analyse(r, records, NOW, shadow_summary(records, "r", 2))
    assert a.shadow is not None
    assert (a.shadow.copies, a.shadow.paired, a.shadow.errors) == (4, 3, 1)
    assert a.shadow.error_class_mismatches == 1
    assert a.shadow.ttft_ratio_p50 == 3.0
    assert a.shadow.e2e_ratio_p50 == 2.0
    assert a.shadow.output_tokens_ratio_p50 == 0.5
    assert (a.shadow.exact_compared, a.shadow.exact_matches) == (2, 1)
    assert (a.shadow.json_checked, a.shadow.json_valid) == (2, 2)
    assert (a.shadow.served_json_checked, a.shadow.served_json_valid) == (2, 1)
    # Shadow records never count in an arm.
    assert a.arms["stable"].requests == a.arms["canary"].requests == 0


def test_what_is_shadowed() -> None:
    c = contract_from_builtins(
        {
            "name": "r",
            "candidates": [
                {"name": "old", "adapter": "openai", "engine": "e", "model": "m"},
                {"name": "new", "adapter": "openai", "engine": "e", "model": "m"},
            ],
            "rollout": {"shadow": {"candidate": "new", "share": 0.25}},
        }
    )

    def req(n: int, op: Op = "chat", cls: str = "interactive") -> InferenceRequest:
        return InferenceRequest(
            id=f"{n:032x}", op=op, cls=cls, model="r", body={}, reply="", deadline=0.0, route="r"
        )

    picked = [shadow.chosen(c, req(n), KEY) for n in range(2000)]
    assert set(picked) == {"new", None}
    assert 0.22 <= picked.count("new") / 2000 <= 0.28
    assert picked == [shadow.chosen(c, req(n), KEY) for n in range(2000)]
    assert {shadow.chosen(c, req(n, op="embedding"), KEY) for n in range(200)} == {None}
    assert {shadow.chosen(c, req(n, cls="agent"), KEY) for n in range(200)} == {None}

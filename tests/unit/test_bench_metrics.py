"""The metric math of `jetserve bench` on synthetic timelines (vLLM's definitions)."""

from __future__ import annotations

import pytest

from jetserve.bench.metrics import (
    added_latency,
    counts,
    generator_check,
    latency,
    max_rate_under_slo,
    percentile,
    stat,
    summarise,
)
from jetserve.bench.slo import Slo, parse_slo
from jetserve.bench.timeline import Outcome, Timeline
from jetserve.bench.workload import RequestSpec


def tl(
    index: int = 0,
    *,
    sent: float = 0.0,
    chunks: tuple[float, ...] = (0.1, 0.15, 0.2, 0.3),
    out: int | None = 4,
    outcome: Outcome = "ok",
    status: int = 200,
    cls: str = "interactive",
    scheduled: float | None = None,
) -> Timeline:
    """A request sent at `sent` (s from the run start) whose output chunks arrive at
    `chunks` (s after sending); the stream ends with its last chunk."""
    ok = outcome == "ok"
    return Timeline(
        index=index,
        cls=cls,
        scheduled=sent if scheduled is None else scheduled,
        sent=sent,
        end=sent + (chunks[-1] if chunks else 0.05),
        outcome=outcome,
        status=status,
        ttft=chunks[0] if chunks else None,
        chunks=list(chunks),
        e2e=chunks[-1] if ok and chunks else None,
        output_tokens=out,
    )


def test_percentile_interpolates_linearly_like_numpy() -> None:
    vals = [4.0, 1.0, 3.0, 2.0]
    assert percentile(vals, 0) == 1.0
    assert percentile(vals, 100) == 4.0
    assert percentile(vals, 50) == pytest.approx(2.5)
    # numpy.percentile([1, 2, 3, 4], 99) == 3.97
    assert percentile(vals, 99) == pytest.approx(3.97)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError, match="percentile of nothing"):
        percentile([], 50)


def test_stat_of_nothing_is_empty() -> None:
    s = stat([])
    assert s.n == 0
    assert s.mean is None
    assert s.p99 is None


def test_ttft_tpot_itl_e2e_of_one_request() -> None:
    t = tl(chunks=(0.1, 0.15, 0.2, 0.3), out=4)
    assert t.ttft == pytest.approx(0.1)
    assert t.e2e == pytest.approx(0.3)
    # TPOT = (e2e - ttft) / (output_tokens - 1)
    assert t.tpot() == pytest.approx((0.3 - 0.1) / 3)
    assert t.itls() == pytest.approx([0.05, 0.05, 0.1])


def test_tpot_uses_usage_tokens_not_chunks() -> None:
    # A gateway may coalesce tokens: 2 chunks carrying 9 tokens.
    t = tl(chunks=(0.1, 0.5), out=9)
    assert t.tpot() == pytest.approx(0.4 / 8)
    assert t.itls() == pytest.approx([0.4])


def test_tpot_undefined_for_one_token_and_falls_back_to_chunks() -> None:
    assert tl(chunks=(0.1,), out=1).tpot() is None
    no_usage = tl(chunks=(0.1, 0.2, 0.3), out=None)
    assert no_usage.output_count() == 3
    assert no_usage.tpot() == pytest.approx(0.1)


def test_latency_covers_completed_requests_and_pools_itl() -> None:
    tls = [
        tl(0, chunks=(0.1, 0.2), out=2),
        tl(1, chunks=(0.3, 0.4, 0.6), out=3),
        tl(2, chunks=(), out=None, outcome="rejected", status=429),
    ]
    lat = latency(tls)
    assert lat.ttft.n == 2
    assert lat.ttft.mean == pytest.approx(0.2)
    assert lat.e2e.n == 2
    assert lat.e2e.p50 == pytest.approx(0.4)  # (0.2 + 0.6) / 2
    assert lat.tpot.n == 2
    assert lat.tpot.mean == pytest.approx((0.1 + 0.15) / 2)
    assert lat.itl.n == 3
    assert lat.itl.max == pytest.approx(0.2)


def test_counts_by_outcome() -> None:
    c = counts(
        [
            tl(0),
            tl(1, outcome="rejected", status=429, chunks=()),
            tl(2, outcome="rejected", status=503, chunks=()),
            tl(3, outcome="timeout", status=504, chunks=()),
            tl(4, outcome="timeout", status=200),  # the client's deadline, mid-stream
            tl(5, outcome="cancelled", status=200),
            tl(6, outcome="error", status=0, chunks=()),
        ]
    )
    assert (c.sent, c.ok, c.rejected, c.timeout, c.cancelled, c.error) == (7, 1, 2, 2, 1, 1)
    assert c.admitted == 3  # the 2xx ones


def test_throughput_goodput_and_attainment() -> None:
    # 4 requests over 2 s: 3 completed (one too slow for the SLO), 1 rejected, 1 cancelled.
    tls = [
        tl(0, sent=0.0, chunks=(0.1, 0.2, 0.3), out=3),
        tl(1, sent=0.5, chunks=(0.1, 0.2, 0.3), out=3),
        tl(2, sent=1.0, chunks=(0.5, 0.6, 1.0), out=3),  # TTFT 500 ms: misses
        tl(3, sent=1.5, chunks=(), out=None, outcome="rejected", status=429),
        tl(4, sent=1.6, chunks=(0.1,), out=None, outcome="cancelled"),
    ]
    tls[3].end = 2.0  # the run ends at 2.0 s
    slo = parse_slo(["ttft=200ms", "tpot=100"])
    s = summarise("t", 2.0, tls, slo=slo)
    assert s.duration_s == pytest.approx(2.0)
    assert s.request_throughput == pytest.approx(3 / 2.0)
    assert s.output_throughput == pytest.approx(9 / 2.0)
    assert s.slo.good == 2
    assert s.slo.eligible == 4  # the cancelled one is not a miss, nor a hit
    assert s.slo.attainment == pytest.approx(0.5)
    assert s.slo.goodput == pytest.approx(1.0)
    assert s.errors == {"rejected 429": 1}


def test_slo_objectives() -> None:
    t = tl(chunks=(0.15, 0.2, 0.25), out=3)  # ttft 150 ms, tpot 50 ms, e2e 250 ms
    assert parse_slo(["ttft=150ms"]).meets(t)
    assert not parse_slo(["ttft=149ms"]).meets(t)
    assert parse_slo(["tpot=50ms"]).meets(t)
    assert not parse_slo(["tpot=0.049s"]).meets(t)
    assert not parse_slo(["e2e=200ms"]).meets(t)
    assert parse_slo(["e2el:300"]).meets(t)  # vLLM's spelling, bare ms
    assert Slo().meets(t)
    assert not Slo().meets(tl(outcome="error", chunks=()))
    # One output token: TPOT is undefined and meets any TPOT objective (as vLLM).
    assert parse_slo(["tpot=1ms"]).meets(tl(chunks=(0.1,), out=1))
    with pytest.raises(ValueError, match="expected ttft="):
        parse_slo(["latency=1s"])


def test_per_class_summaries() -> None:
    tls = [tl(0, cls="interactive"), tl(1, cls="batch", chunks=(1.0, 2.0), out=2)]
    s = summarise("t", 1.0, tls, slo=parse_slo(["ttft=500ms"]))
    assert set(s.per_class) == {"batch", "interactive"}
    assert s.per_class["batch"].latency.ttft.p50 == pytest.approx(1.0)
    assert s.per_class["batch"].slo.attainment == 0.0
    assert s.per_class["interactive"].slo.attainment == 1.0


def test_short_outputs_are_counted() -> None:
    sched = [RequestSpec(index=0, at=0.0, cls="interactive", input_tokens=8, output_tokens=10)]
    s = summarise("t", 1.0, [tl(0, out=4)], slo=Slo(), schedule=sched)
    assert s.short_outputs == 1


def test_generator_lag_flags_a_run_that_fell_behind() -> None:
    on_time = [tl(i, sent=i * 0.1 + 0.001, scheduled=i * 0.1) for i in range(100)]
    check = generator_check(on_time, max_lag=0.025)
    assert not check.behind
    assert check.lag.p99 == pytest.approx(0.001)
    assert check.scheduled_rate == pytest.approx(10.0)
    late = [
        tl(i, sent=i * 0.1 + (0.2 if i % 10 == 0 else 0.0), scheduled=i * 0.1) for i in range(100)
    ]
    assert generator_check(late, max_lag=0.025).behind


def test_added_latency_is_the_difference_at_each_percentile() -> None:
    base = summarise(
        "direct", 1.0, [tl(i, chunks=(0.1 + i / 100, 0.5)) for i in range(100)], slo=Slo()
    )
    gw = summarise(
        "gw", 1.0, [tl(i, chunks=(0.105 + i / 100, 0.51)) for i in range(100)], slo=Slo()
    )
    added = added_latency(gw, base)
    assert added.baseline == "direct"
    for key in ("mean", "p50", "p90", "p95", "p99"):
        assert added.ttft.get(key) == pytest.approx(0.005)
        assert added.e2e.get(key) == pytest.approx(0.01)


def test_max_rate_under_slo() -> None:
    cap = max_rate_under_slo([(2, 1.0), (4, 0.95), (8, 0.5), (16, 0.95)], 0.9)
    assert cap.max_rate == 4
    assert not cap.all_held  # 16 held by luck: past the failure
    assert cap.highest_held == 16
    assert max_rate_under_slo([(4, 0.99), (2, 1.0)], 0.9).all_held
    assert max_rate_under_slo([(4, 0.99), (2, 1.0)], 0.9).max_rate == 4
    none = max_rate_under_slo([(2, 0.5), (4, 1.0)], 0.9)
    assert none.max_rate is None
    assert not none.all_held
    assert max_rate_under_slo([(2, None)], 0.9).max_rate is None

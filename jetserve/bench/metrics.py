"""Metrics with vLLM's definitions (`vllm bench serve`), from recorded timelines.

- TTFT: from sending the request to the first chunk that carries output.
- TPOT, per request: (e2e - TTFT) / (output_tokens - 1), for requests with more than
  one output token; output_tokens come from the usage chunk.
- ITL: the gap between successive output chunks, pooled over all requests.
- E2E: from sending to the end of the stream.
- Percentiles interpolate linearly between ranks (numpy's default).
- Latencies cover completed (`ok`) requests; counts cover every request sent.
- Throughput: completed requests and their output tokens per second of the run's
  duration (first send to last end).
- Goodput: completed requests that met every SLO, per second. SLO attainment: their
  share of the requests sent, less those the workload cancelled on purpose; a
  rejected, timed-out or failed request counts as a miss.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from jetserve.bench.slo import Slo
from jetserve.bench.timeline import Timeline
from jetserve.bench.workload import RequestSpec

PCTS = (50, 90, 95, 99)
CDF_POINTS = 51  # TTFT quantiles kept per run for CDF plots (every 2%)
DEFAULT_MAX_LAG = 0.025  # seconds of p99 send lag before a run is flagged (docs/bench.md)


def percentile(
    values: Sequence[float], q: float, *, method: Literal["linear", "nearest"] = "linear"
) -> float:
    """The q-th percentile (0..100) of the whole bench package. ``linear``: between
    closest ranks, as numpy's default (vLLM's definitions); ``nearest``: the
    nearest-rank value, always a sample (the fleet scenarios' tables)."""
    if not values:
        raise ValueError("percentile of nothing")
    ordered = sorted(values)
    if method == "nearest":
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
    rank = q / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


class Stat(msgspec.Struct, kw_only=True):
    n: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    def get(self, key: str) -> float | None:
        value: float | None = getattr(self, key)
        return value


def stat(values: Sequence[float]) -> Stat:
    if not values:
        return Stat(n=0)
    ordered = sorted(values)
    return Stat(
        n=len(ordered),
        mean=math.fsum(ordered) / len(ordered),
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p95=percentile(ordered, 95),
        p99=percentile(ordered, 99),
        max=ordered[-1],
    )


class Counts(msgspec.Struct, kw_only=True):
    sent: int = 0
    admitted: int = 0  # a 2xx status came back
    ok: int = 0
    rejected: int = 0  # 429 / 503
    timeout: int = 0  # 504 / 408, or the client's deadline
    cancelled: int = 0  # by the workload, on purpose
    error: int = 0


class Latency(msgspec.Struct, kw_only=True):
    ttft: Stat
    tpot: Stat
    itl: Stat
    e2e: Stat


class SloResult(msgspec.Struct, kw_only=True):
    good: int
    eligible: int  # sent - cancelled
    attainment: float | None
    goodput: float  # good requests per second


class GeneratorCheck(msgspec.Struct, kw_only=True):
    lag: Stat  # actual - scheduled send time
    scheduled_rate: float
    achieved_rate: float
    max_lag: float  # the threshold applied
    behind: bool


class ClassSummary(msgspec.Struct, kw_only=True):
    counts: Counts
    latency: Latency
    slo: SloResult
    output_throughput: float


class RunSummary(msgspec.Struct, kw_only=True):
    target: str
    rate: float  # offered, req/s
    duration_s: float
    counts: Counts
    latency: Latency
    request_throughput: float
    output_throughput: float
    input_tokens_mean: float | None
    output_tokens_mean: float | None
    cached_token_share: float | None  # prompt tokens served from the prefix cache
    short_outputs: int  # completed with fewer tokens than asked (ignore_eos dropped?)
    slo: SloResult
    per_class: dict[str, ClassSummary]
    generator: GeneratorCheck
    ttft_quantiles: list[float]  # seconds, at 0, 2, ..., 100 %
    errors: dict[str, int]  # "outcome status error" -> count


def counts(tls: Iterable[Timeline]) -> Counts:
    c = Counts()
    for t in tls:
        c.sent += 1
        c.admitted += t.admitted
        setattr(c, t.outcome, getattr(c, t.outcome) + 1)
    return c


def latency(tls: Sequence[Timeline]) -> Latency:
    ok = [t for t in tls if t.outcome == "ok"]
    return Latency(
        ttft=stat([t.ttft for t in ok if t.ttft is not None]),
        tpot=stat([v for t in ok if (v := t.tpot()) is not None]),
        itl=stat([gap for t in ok for gap in t.itls()]),
        e2e=stat([t.e2e for t in ok if t.e2e is not None]),
    )


def duration(tls: Sequence[Timeline]) -> float:
    if not tls:
        return 0.0
    return max(t.end for t in tls) - min(t.sent for t in tls)


def slo_result(tls: Sequence[Timeline], slo: Slo, dur: float) -> SloResult:
    eligible = sum(1 for t in tls if t.outcome != "cancelled")
    good = sum(1 for t in tls if slo.meets(t))
    return SloResult(
        good=good,
        eligible=eligible,
        attainment=good / eligible if eligible else None,
        goodput=good / dur if dur > 0 else 0.0,
    )


def _rate(times: Sequence[float]) -> float:
    if len(times) < 2:
        return 0.0
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else math.inf


def generator_check(tls: Sequence[Timeline], max_lag: float = DEFAULT_MAX_LAG) -> GeneratorCheck:
    lag = stat([t.lag for t in tls])
    return GeneratorCheck(
        lag=lag,
        scheduled_rate=_rate([t.scheduled for t in tls]),
        achieved_rate=_rate([t.sent for t in tls]),
        max_lag=max_lag,
        behind=lag.p99 is not None and lag.p99 > max_lag,
    )


def _output_tokens(tls: Iterable[Timeline]) -> int:
    return sum(t.output_count() for t in tls if t.outcome == "ok")


def summarise(
    target: str,
    rate: float,
    tls: Sequence[Timeline],
    *,
    slo: Slo,
    schedule: Sequence[RequestSpec] = (),
    max_lag: float = DEFAULT_MAX_LAG,
) -> RunSummary:
    dur = duration(tls)
    ok = [t for t in tls if t.outcome == "ok"]
    asked = {r.index: r.output_tokens for r in schedule}
    prompt = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
    cached = [t.cached_tokens or 0 for t in ok if t.prompt_tokens is not None]
    per_class: dict[str, ClassSummary] = {}
    for cls in sorted({t.cls for t in tls}):
        mine = [t for t in tls if t.cls == cls]
        per_class[cls] = ClassSummary(
            counts=counts(mine),
            latency=latency(mine),
            slo=slo_result(mine, slo, dur),
            output_throughput=_output_tokens(mine) / dur if dur > 0 else 0.0,
        )
    ttfts = sorted(t.ttft for t in ok if t.ttft is not None)
    return RunSummary(
        target=target,
        rate=rate,
        duration_s=dur,
        counts=counts(tls),
        latency=latency(tls),
        request_throughput=len(ok) / dur if dur > 0 else 0.0,
        output_throughput=_output_tokens(tls) / dur if dur > 0 else 0.0,
        input_tokens_mean=math.fsum(prompt) / len(prompt) if prompt else None,
        output_tokens_mean=_output_tokens(ok) / len(ok) if ok else None,
        cached_token_share=math.fsum(cached) / math.fsum(prompt) if sum(prompt) else None,
        short_outputs=sum(1 for t in ok if t.index in asked and t.output_count() < asked[t.index]),
        slo=slo_result(tls, slo, dur),
        per_class=per_class,
        generator=generator_check(tls, max_lag),
        ttft_quantiles=[percentile(ttfts, 100 * i / (CDF_POINTS - 1)) for i in range(CDF_POINTS)]
        if ttfts
        else [],
        errors=dict(
            Counter(
                f"{t.outcome} {t.status or '-'} {t.error}".strip()
                for t in tls
                if t.outcome not in ("ok", "cancelled")
            ).most_common(10)
        ),
    )


class Delta(msgspec.Struct, kw_only=True):
    """target - baseline at each statistic, in seconds (positive: the target is slower)."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None

    def get(self, key: str) -> float | None:
        value: float | None = getattr(self, key)
        return value


class Added(msgspec.Struct, kw_only=True):
    baseline: str
    ttft: Delta
    e2e: Delta


def delta(a: Stat, b: Stat) -> Delta:
    def d(key: str) -> float | None:
        x, y = a.get(key), b.get(key)
        return None if x is None or y is None else x - y

    return Delta(mean=d("mean"), p50=d("p50"), p90=d("p90"), p95=d("p95"), p99=d("p99"))


def added_latency(run: RunSummary, base: RunSummary) -> Added:
    """A gateway's added latency: its percentiles minus the direct target's, for the
    same workload at the same offered load."""
    return Added(
        baseline=base.target,
        ttft=delta(run.latency.ttft, base.latency.ttft),
        e2e=delta(run.latency.e2e, base.latency.e2e),
    )


class Capacity(msgspec.Struct, kw_only=True):
    max_rate: float | None  # the highest rate held with every lower one, None if the lowest failed
    all_held: bool  # every swept rate held: the limit lies beyond the sweep
    attainment: dict[str, float | None]  # rate -> attainment, for the record
    highest_held: float | None = None  # the highest rate held at all (a dip below may exist)


def max_rate_under_slo(points: Sequence[tuple[float, float | None]], target: float) -> Capacity:
    """The highest offered rate at which SLO attainment stays at or above `target`,
    with every lower swept rate holding too (one lucky point past saturation does not
    count)."""
    best: float | None = None
    held_all = True
    for rate, att in sorted(points):
        if att is None or att < target:
            held_all = False
            break
        best = rate
    held = [r for r, a in points if a is not None and a >= target]
    return Capacity(
        max_rate=best,
        all_held=held_all and bool(points),
        attainment={f"{r:g}": a for r, a in sorted(points)},
        highest_held=max(held) if held else None,
    )

"""The figures of `jetserve bench capacity`, from what a closed-loop run recorded:
per target and concurrency level, the completed requests, their rate and latency,
and the CPU each component spent per request; then the highest rate per target and
the ratios between targets. Pure functions over plain data: the run itself is in
``capacity.py``, the output in ``capacity_report.py``.

A request counts in a level when it ended inside the measured window; the CPU
figures are the /proc deltas over the same window, so in steady state (the clients
ran through a warm-up first) a request's share is its component's CPU over the
window divided by the requests completed in it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from jetserve.bench.metrics import Stat, stat
from jetserve.bench.timeline import Timeline

SCHEMA = "jetserve-bench-capacity/1"

# CpuMeter groups (fleet/targets.py's process names) -> the components of the tables.
LABELS = {
    "engine": "engine",
    "gateway": "gateway",
    "workers": "worker",
    "nats": "nats-server",
    "redis": "redis-server",
    "litellm": "proxy",
}
COMPONENTS = ("engine", "gateway", "worker", "nats-server", "redis-server", "proxy")
RATIOS = (("jetserve", "direct"), ("jetserve", "litellm"))


def parse_levels(text: str) -> list[int]:
    """`1,4,16,32` -> [1, 4, 16, 32]: concurrency levels, each >= 1, sorted, once each."""
    levels: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"a concurrency level is a whole number: {part!r}") from None
        if value < 1:
            raise ValueError(f"a concurrency level must be >= 1: {part!r}")
        levels.add(value)
    if not levels:
        raise ValueError(f"no concurrency levels in {text!r}")
    return sorted(levels)


def components(target: str, cpu_path: dict[str, list[str]]) -> list[str]:
    """The components that serve `target`: the engine, then its path's processes
    (fleet meta's ``cpu_path``: gateway, workers, nats, redis for jetserve)."""
    return ["engine", *(LABELS.get(g, g) for g in cpu_path.get(target, []))]


class Level(msgspec.Struct, kw_only=True):
    target: str
    concurrency: int
    window_s: float
    completed: int  # ok requests that ended inside the window
    errors: int  # failed ones that ended inside it
    error_kinds: dict[str, int]  # "outcome status error" -> count
    req_per_s: float
    e2e: Stat  # seconds
    ttft: Stat | None  # seconds; streaming only
    p99_over_p50: float | None  # of e2e: how long the tail is
    output_tokens: dict[str, int]  # min / max per completed request (ignore_eos: max_tokens)
    cpu_s: dict[str, float]  # every group over the window, by component label
    components: list[str]  # those that serve this target
    cpu_ms_per_request: dict[str, float]  # by component, for `components`
    cpu_ms_total: float | None  # their sum
    generator_cores: float | None  # the load generator's own use, in cores
    generator_ms_per_request: float | None  # ... and per completed request
    other_cores: float | None  # processes outside the benchmark, in cores
    clients: int = 0  # httpx pools the generator used
    # Requests open when the window closed that then failed, or never ended (cut after
    # closedloop.AFTER_WINDOW_S): a hung request also took a client out of the window.
    failed_after_window: int = 0


def in_window(tls: Sequence[Timeline], window: tuple[float, float]) -> list[Timeline]:
    lo, hi = window
    return [t for t in tls if lo <= t.end <= hi]


def aggregate(
    target: str,
    concurrency: int,
    timelines: Sequence[Timeline],
    window: tuple[float, float],
    cpu_delta: dict[str, float],
    serving: list[str],
    *,
    stream: bool,
    clients: int = 0,
    unfinished: int = 0,
) -> Level:
    """One level's figures. `cpu_delta` is ``CpuMeter.delta`` over the window (CpuMeter
    group names, plus ``generator`` and ``other``); `serving` the target's components."""
    span = max(window[1] - window[0], 0.0)
    inside = in_window(timelines, window)
    ok = [t for t in inside if t.outcome == "ok"]
    bad = [t for t in inside if t.outcome != "ok"]
    e2e = stat([t.e2e for t in ok if t.e2e is not None])
    ttft = stat([t.ttft for t in ok if t.ttft is not None]) if stream else None
    tokens = [t.output_count() for t in ok]
    cpu = {LABELS.get(k, k): v for k, v in cpu_delta.items()}
    per_req: dict[str, float] = {}
    if ok and cpu:
        per_req = {c: round(1000 * cpu.get(c, 0.0) / len(ok), 3) for c in serving}
    return Level(
        target=target,
        concurrency=concurrency,
        window_s=round(span, 4),
        completed=len(ok),
        errors=len(bad),
        error_kinds=dict(Counter(f"{t.outcome} {t.status} {t.error}".strip() for t in bad)),
        req_per_s=len(ok) / span if span > 0 else 0.0,
        e2e=e2e,
        ttft=ttft,
        p99_over_p50=tail_ratio(e2e),
        output_tokens={"min": min(tokens), "max": max(tokens)} if tokens else {},
        cpu_s=cpu,
        components=list(serving),
        cpu_ms_per_request=per_req,
        cpu_ms_total=round(sum(per_req.values()), 3) if per_req else None,
        generator_cores=_cores(cpu.get("generator"), span),
        generator_ms_per_request=(
            round(1000 * cpu["generator"] / len(ok), 3) if ok and "generator" in cpu else None
        ),
        other_cores=_cores(cpu.get("other"), span),
        clients=clients,
        failed_after_window=unfinished
        + sum(1 for t in timelines if t.end > window[1] and t.outcome != "ok"),
    )


def tail_ratio(s: Stat) -> float | None:
    if s.p50 is None or s.p99 is None or s.p50 <= 0:
        return None
    return s.p99 / s.p50


def _cores(seconds: float | None, span: float) -> float | None:
    return round(seconds / span, 3) if seconds is not None and span > 0 else None


class MaxRate(msgspec.Struct, kw_only=True):
    req_per_s: float
    concurrency: int  # the level that reached it
    cpu_ms_total: float | None  # CPU per request at that level


def max_rates(levels: Sequence[Level]) -> dict[str, MaxRate]:
    """Per target, the highest completion rate over its levels (the lower level on a tie)."""
    best: dict[str, Level] = {}
    for lv in levels:
        cur = best.get(lv.target)
        if cur is None or lv.req_per_s > cur.req_per_s:
            best[lv.target] = lv
    return {
        name: MaxRate(
            req_per_s=lv.req_per_s, concurrency=lv.concurrency, cpu_ms_total=lv.cpu_ms_total
        )
        for name, lv in best.items()
    }


def ratios(maxes: dict[str, MaxRate]) -> dict[str, float | None]:
    """`jetserve/direct` and `jetserve/litellm` of the max rates (None: a target missing)."""
    out: dict[str, float | None] = {}
    for a, b in RATIOS:
        ra, rb = maxes.get(a), maxes.get(b)
        if ra is None or rb is None or rb.req_per_s <= 0:
            out[f"{a}/{b}"] = None
        else:
            out[f"{a}/{b}"] = ra.req_per_s / rb.req_per_s
    return out


def highest(levels: Sequence[Level]) -> dict[str, Level]:
    """Per target, its highest concurrency level."""
    out: dict[str, Level] = {}
    for lv in levels:
        if lv.target not in out or lv.concurrency > out[lv.target].concurrency:
            out[lv.target] = lv
    return out


class CapacityResults(msgspec.Struct, kw_only=True):
    schema: str = SCHEMA
    meta: dict[str, object]
    config: dict[str, object]
    targets: list[dict[str, object]]
    levels: list[Level]
    max_rate: dict[str, MaxRate] = msgspec.field(default_factory=dict)
    ratios: dict[str, float | None] = msgspec.field(default_factory=dict)
    tail_at_highest: dict[str, float | None] = msgspec.field(default_factory=dict)

    def target_names(self) -> list[str]:
        return list(dict.fromkeys(lv.target for lv in self.levels))


def build(
    levels: list[Level],
    *,
    meta: dict[str, object],
    config: dict[str, object],
    targets: list[dict[str, object]],
) -> CapacityResults:
    maxes = max_rates(levels)
    return CapacityResults(
        meta=meta,
        config=config,
        targets=targets,
        levels=levels,
        max_rate=maxes,
        ratios=ratios(maxes),
        tail_at_highest={name: lv.p99_over_p50 for name, lv in highest(levels).items()},
    )


def encode(res: CapacityResults) -> bytes:
    return msgspec.json.format(msgspec.json.encode(res), indent=2) + b"\n"


def decode(raw: bytes) -> CapacityResults:
    return msgspec.json.decode(raw, type=CapacityResults)

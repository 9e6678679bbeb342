"""Results: one JSON file (summaries, no per-request data) and
optionally the raw timelines as gzip'd JSONL. The markdown summary: summary.py."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import msgspec

from jetserve.bench.metrics import Added, Capacity, RunSummary, max_rate_under_slo
from jetserve.bench.sweep import RunRecord

SCHEMA = "jetserve-bench/1"


class RunEntry(msgspec.Struct, kw_only=True):
    target: str
    rate: float
    summary: RunSummary
    added: Added | None = None
    started_unix: float = 0.0
    clients: int = 0
    warmup_errors: list[str] = msgspec.field(default_factory=list)
    cpu: dict[str, float] = msgspec.field(default_factory=dict)  # CPU s by process group
    other_cores: float | None = None  # cores taken by processes outside the benchmark
    attempts: int = 1


class Headline(msgspec.Struct, kw_only=True):
    """A gateway's added TTFT vs the baseline at light load (the lowest rate) and at
    the highest rate the baseline sustained under the SLO, and its own capacity."""

    target: str
    baseline: str
    light_rate: float
    added_ttft_p50_light: float | None
    added_ttft_p99_light: float | None
    held_rate: float | None
    added_ttft_p50_held: float | None
    added_ttft_p99_held: float | None
    max_rate_under_slo: float | None
    all_held: bool


class Results(msgspec.Struct, kw_only=True):
    schema: str = SCHEMA
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    workload: dict[str, Any] = msgspec.field(default_factory=dict)
    slo: dict[str, float] = msgspec.field(default_factory=dict)
    slo_target: float = 0.9
    max_lag_ms: float = 0.0
    baseline: str | None = None
    targets: list[dict[str, Any]] = msgspec.field(default_factory=list)
    rates: list[float] = msgspec.field(default_factory=list)
    runs: list[RunEntry] = msgspec.field(default_factory=list)
    capacity: dict[str, Capacity] = msgspec.field(default_factory=dict)
    headline: list[Headline] = msgspec.field(default_factory=list)

    def run(self, target: str, rate: float) -> RunEntry | None:
        return next((r for r in self.runs if r.target == target and r.rate == rate), None)

    def target_names(self) -> list[str]:
        return [str(t["name"]) for t in self.targets]


def build_results(
    records: list[RunRecord],
    *,
    targets: list[dict[str, Any]],
    baseline: str | None,
    slo: dict[str, float],
    slo_target: float,
    max_lag: float,
    workload: dict[str, Any],
    meta: dict[str, Any],
) -> Results:
    runs = [
        RunEntry(
            target=r.target,
            rate=r.rate,
            summary=r.summary,
            added=r.added,
            started_unix=r.started_unix,
            clients=r.clients,
            warmup_errors=r.warmup_errors,
            cpu=r.cpu,
            other_cores=r.other_cores,
            attempts=r.attempts,
        )
        for r in records
    ]
    res = Results(
        meta=meta,
        workload=workload,
        slo=slo,
        slo_target=slo_target,
        max_lag_ms=max_lag * 1000,
        baseline=baseline,
        targets=targets,
        rates=sorted({r.rate for r in records}),
        runs=runs,
    )
    return derive(res)


def derive(res: Results) -> Results:
    """(Re)compute what follows from the runs: capacity per target and the headline."""
    res.capacity = {}
    for name in res.target_names():
        points = [(r.rate, r.summary.slo.attainment) for r in res.runs if r.target == name]
        res.capacity[name] = max_rate_under_slo(points, res.slo_target)
    res.headline = headlines(res)
    return res


def headlines(res: Results) -> list[Headline]:
    if res.baseline is None or not res.rates:
        return []
    light = res.rates[0]
    held = res.capacity.get(res.baseline, Capacity(max_rate=None, all_held=False, attainment={}))
    out = []
    for name in res.target_names():
        if name == res.baseline:
            continue
        at_light = res.run(name, light)
        at_held = res.run(name, held.max_rate) if held.max_rate is not None else None
        cap = res.capacity[name]

        def pick(entry: RunEntry | None, key: str) -> float | None:
            return entry.added.ttft.get(key) if entry and entry.added else None

        out.append(
            Headline(
                target=name,
                baseline=res.baseline,
                light_rate=light,
                added_ttft_p50_light=pick(at_light, "p50"),
                added_ttft_p99_light=pick(at_light, "p99"),
                held_rate=held.max_rate,
                added_ttft_p50_held=pick(at_held, "p50"),
                added_ttft_p99_held=pick(at_held, "p99"),
                max_rate_under_slo=cap.max_rate,
                all_held=cap.all_held,
            )
        )
    return out


# -- files -------------------------------------------------------------------


def write_json(res: Results, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(res), indent=1) + b"\n")


def load_results(path: str | Path) -> Results:
    data = Path(path).read_bytes()
    try:
        res = msgspec.json.decode(data, type=Results)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{path}: not a jetserve bench results file: {exc}") from None
    if res.schema != SCHEMA:
        raise ValueError(f"{path}: schema {res.schema!r}, expected {SCHEMA!r}")
    return res


class _RawLine(msgspec.Struct):
    target: str
    rate: float
    timeline: Any


def write_raw(records: list[RunRecord], path: Path) -> None:
    """Every request's timeline, one JSON line each, gzip'd (for offline analysis)."""
    enc = msgspec.json.Encoder()
    with gzip.open(path, "wb") as fh:
        for r in records:
            for t in r.timelines:
                fh.write(enc.encode(_RawLine(r.target, r.rate, t)) + b"\n")

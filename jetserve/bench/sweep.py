"""The sweep: every offered load, against every target, one run after another.

Loads go from low to high; at each load the targets take turns (their order rotates
from one load to the next, so no target always runs first after an idle engine),
each with the same schedule. Between runs the sweep waits for the engine to go idle
(when it can see its metrics) and then a short cool-down.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable

import httpx
import msgspec
import uvloop

from jetserve.bench.cpu import CpuMeter, wait_quiet
from jetserve.bench.loadgen import Job, LoadResult, run_in_subprocess, run_job
from jetserve.bench.metrics import (
    DEFAULT_MAX_LAG,
    Added,
    RunSummary,
    added_latency,
    summarise,
)
from jetserve.bench.progress import ProgressBar
from jetserve.bench.prompts import Api
from jetserve.bench.slo import Slo
from jetserve.bench.targets import Target
from jetserve.bench.timeline import Timeline
from jetserve.bench.trace import at_rate, mean_rate
from jetserve.bench.units import fmt_rate
from jetserve.bench.workload import RequestSpec, WorkloadSpec, build_schedule


class SweepConfig(msgspec.Struct, kw_only=True):
    workload: WorkloadSpec = msgspec.field(default_factory=WorkloadSpec)
    rates: list[float] | None = None  # None: the trace at its own pace (one point)
    duration: float | None = 30.0  # seconds of arrivals per point
    count: int | None = None  # or this many requests per point
    trace: list[RequestSpec] | None = None
    slo: Slo = msgspec.field(default_factory=Slo)
    slo_target: float = 0.9
    max_lag: float = DEFAULT_MAX_LAG
    model: str = "sim-8b"
    api: Api = "chat"
    ignore_eos: bool = True
    class_header: str = "X-Jetserve-Class"
    request_timeout: float = 60.0
    drain: float = 30.0
    cooldown: float = 2.0
    idle_timeout: float = 60.0
    wait_quiet: float = 0.0  # > 0: before each run, wait until others use <= this many cores
    wait_quiet_max: float = 120.0
    max_other: float = 0.0  # > 0: run again when others took more cores than this during a run
    retries: int = 2
    conns_per_client: int = 10
    max_clients: int = 200
    warmup: int = 2
    in_process: bool = False  # run the generator in this process (tests, debugging)


class RunRecord(msgspec.Struct, kw_only=True):
    target: str
    rate: float
    summary: RunSummary
    added: Added | None
    started_unix: float
    clients: int
    warmup_errors: list[str]
    timelines: list[Timeline]
    cpu: dict[str, float] = msgspec.field(default_factory=dict)  # CPU s by process group
    other_cores: float | None = None  # what processes outside the benchmark took, on average
    attempts: int = 1


def schedules(cfg: SweepConfig) -> list[tuple[float, list[RequestSpec]]]:
    """(offered rate, schedule) per sweep point, in sweep order (low to high)."""
    if cfg.trace is not None:
        if cfg.rates is None:
            return [(mean_rate(cfg.trace), cfg.trace)]
        return [(r, at_rate(cfg.trace, r)) for r in sorted(cfg.rates)]
    if cfg.rates is None:
        raise ValueError("give rates (--rate or --sweep) or a trace")
    return [
        (r, build_schedule(cfg.workload, r, duration=cfg.duration, count=cfg.count))
        for r in sorted(cfg.rates)
    ]


def run_salt(seed: int, rate: float, target: str, attempt: int = 1) -> str:
    """One word, unique to (seed, rate, target, attempt): see prompts.py for why. A
    repeated run needs its own too, or it would hit the cache its first attempt warmed."""
    key = f"{seed}:{rate:g}:{target}" + (f":{attempt}" if attempt > 1 else "")
    return "z" + hashlib.sha256(key.encode()).hexdigest()[:10]


def engine_busy(metrics_url: str) -> float | None:
    """Running + waiting requests from a vLLM-style /metrics page, None if unreadable."""
    try:
        text = httpx.get(metrics_url, timeout=2.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                return None
    return total


def wait_idle(
    metrics_url: str, timeout: float, sleep: Callable[[float], None] = time.sleep
) -> bool:
    """Until the engine reports nothing running or waiting twice in a row."""
    end = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < end:
        busy = engine_busy(metrics_url)
        if busy is None:
            return False
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return True
        sleep(0.1)
    return False


def _say(text: str) -> None:
    print(f"jetserve bench: {text}", file=sys.stderr, flush=True)


def run_sweep(
    cfg: SweepConfig,
    targets: list[Target],
    *,
    baseline: str | None = None,
    engine_metrics: str | None = None,
    progress: ProgressBar | None = None,
    processes: dict[str, list[int]] | None = None,
) -> list[RunRecord]:
    points = schedules(cfg)
    meter = CpuMeter(processes or {})
    records: list[RunRecord] = []
    for n_point, (rate, schedule) in enumerate(points):
        k = n_point % len(targets)
        order = targets[k:] + targets[:k]
        by_target: dict[str, RunRecord] = {}
        for target in order:
            by_target[target.name] = _measure(
                cfg, target, rate, schedule, meter, engine_metrics, progress
            )
        base = by_target.get(baseline) if baseline else None
        for target in targets:  # report in the targets' own order
            rec = by_target[target.name]
            if base is not None and rec is not base:
                rec.added = added_latency(rec.summary, base.summary)
            records.append(rec)
    return records


def _measure(
    cfg: SweepConfig,
    target: Target,
    rate: float,
    schedule: list[RequestSpec],
    meter: CpuMeter,
    engine_metrics: str | None,
    progress: ProgressBar | None,
) -> RunRecord:
    """One target at one rate; run again (up to cfg.retries times) while processes
    outside the benchmark took more than cfg.max_other cores during it, keeping the
    least disturbed attempt."""
    label = f"{target.name} @ {fmt_rate(rate)} req/s"
    best: RunRecord | None = None
    tries = 1 + (cfg.retries if cfg.max_other > 0 else 0)
    for attempt in range(1, tries + 1):
        rec = _attempt(cfg, target, rate, schedule, meter, engine_metrics, progress, label, attempt)
        rec.attempts = attempt
        if best is None or (rec.other_cores or 0.0) < (best.other_cores or 0.0):
            best = rec
        if cfg.max_other <= 0 or (rec.other_cores or 0.0) <= cfg.max_other:
            break
        if attempt < tries:
            _say(
                f"{label}: other processes took {rec.other_cores:.2f} cores during the run; "
                "running it again"
            )
            if progress is not None:
                progress.extend(len(schedule))
    assert best is not None
    best.attempts = attempt
    return best


def _attempt(
    cfg: SweepConfig,
    target: Target,
    rate: float,
    schedule: list[RequestSpec],
    meter: CpuMeter,
    engine_metrics: str | None,
    progress: ProgressBar | None,
    label: str,
    attempt: int,
) -> RunRecord:
    if engine_metrics is not None and not wait_idle(engine_metrics, cfg.idle_timeout):
        _say(f"engine still busy after {cfg.idle_timeout:g}s; starting anyway")
    time.sleep(cfg.cooldown)
    if cfg.wait_quiet > 0:
        cores = wait_quiet(meter, cfg.wait_quiet, cfg.wait_quiet_max)
        if cores is not None and cores > cfg.wait_quiet:
            _say(f"other processes still use {cores:.1f} cores; starting anyway")
    job = Job(
        target=target,
        requests=schedule,
        model=cfg.model,
        salt=run_salt(cfg.workload.seed, rate, target.name, attempt),
        seed=cfg.workload.seed,
        api=cfg.api,
        ignore_eos=cfg.ignore_eos,
        class_header=cfg.class_header,
        request_timeout=cfg.request_timeout,
        drain=cfg.drain,
        conns_per_client=cfg.conns_per_client,
        max_clients=cfg.max_clients,
        warmup=cfg.warmup,
    )
    if progress is not None:
        progress.start_run(label, len(schedule))
    cpu0 = meter.sample()
    result = _run(job, cfg.in_process, progress.update if progress else None)
    cpu = CpuMeter.delta(cpu0, meter.sample())
    if cpu:
        cpu["generator"] = round(result.cpu_s, 3)
    if progress is not None:
        progress.end_run()
    summary = summarise(
        target.name, rate, result.timelines, slo=cfg.slo, schedule=schedule, max_lag=cfg.max_lag
    )
    if result.warmup_errors:
        _say(f"{label}: warm-up failed: {result.warmup_errors[0]}")
    other = cpu.get("other")
    return RunRecord(
        target=target.name,
        rate=rate,
        summary=summary,
        added=None,
        started_unix=result.started_unix,
        clients=result.clients,
        warmup_errors=result.warmup_errors,
        timelines=result.timelines,
        cpu=cpu,
        other_cores=(
            round(other / summary.duration_s, 3)
            if other is not None and summary.duration_s > 0
            else None
        ),
    )


def _run(
    job: Job, in_process: bool, on_progress: Callable[[int, int, int], None] | None
) -> LoadResult:
    if in_process:
        return uvloop.run(run_job(job, on_progress))
    return run_in_subprocess(job, on_progress)

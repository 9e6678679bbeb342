"""The `jetserve bench` commands: run (a sweep against targets), plan, report and
fleet (the fleet-routing scenarios, ``fleet/scenarios.py``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jetserve.bench import plots
from jetserve.bench.fleet.targets import FleetOptions, LocalTargets, local_fleet
from jetserve.bench.plan import capacity_plan, render
from jetserve.bench.progress import ProgressBar
from jetserve.bench.report import (
    Results,
    build_results,
    derive,
    load_results,
    write_json,
    write_raw,
)
from jetserve.bench.slo import parse_slo
from jetserve.bench.summary import markdown
from jetserve.bench.sweep import RunRecord, SweepConfig, run_sweep, schedules
from jetserve.bench.targets import Target
from jetserve.bench.trace import read_trace, write_trace
from jetserve.bench.units import fmt_rate
from jetserve.bench.workload import ClassSpec, WorkloadSpec


def cmd_fleet(args: argparse.Namespace) -> int:
    import asyncio

    from jetserve.bench.fleet.plots import write_fleet_plots
    from jetserve.bench.fleet.scenarios import SCENARIOS, Options, render, run_all

    wanted = tuple(s.strip() for s in args.scenario.split(",") if s.strip())
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    opts = Options(
        scenarios=wanted, out=Path(args.out), seed=args.seed, rate=args.rate,
        duration=args.duration, replicas=args.replicas, warmup=args.warmup,
        lanes=args.lanes, lane_load_factor=args.lane_load_factor,
    )  # fmt: skip
    results = asyncio.run(run_all(opts))
    # Scenarios not rerun keep their last results in the summary and plots.
    for name in SCENARIOS:
        kept = opts.out / f"{name}.json"
        if name not in results and kept.exists():
            results[name] = json.loads(kept.read_text())
    results = {name: results[name] for name in SCENARIOS if name in results}
    summary = "\n\n".join(render(r) for r in results.values())
    (opts.out / "summary.md").write_text(summary + "\n")
    write_fleet_plots(results, opts.out)
    print(f"results: {opts.out}/<scenario>.json, summary.md and <scenario>.png")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    res = load_results(args.results)
    plan = capacity_plan(
        res,
        target=args.target,
        peak_rate=args.peak_rate,
        rho_max=args.rho_max,
        replicas=args.replicas,
    )
    print(render(plan, args.results))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    res = derive(load_results(args.results))
    write_json(res, Path(args.results))  # the derived parts follow the current definitions
    out = Path(args.out) if args.out else Path(args.results).parent
    out.mkdir(parents=True, exist_ok=True)
    names = _plots(res, out, args.no_plots)
    (out / "summary.md").write_text(markdown(res, names))
    print(f"wrote {out / 'summary.md'}" + (f" and {len(names)} plots" if names else ""))
    return 0


def _plots(res: Results, out: Path, skip: bool) -> list[str]:
    if skip:
        return []
    if not plots.available():
        print(
            "jetserve bench: matplotlib missing (pip install 'jetserve[bench]'): no plots",
            file=sys.stderr,
        )
        return []
    return plots.write_plots(res, out)


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    classes: tuple[ClassSpec, ...] = tuple(args.classes) or (
        ClassSpec(name="interactive", weight=1.0),
    )
    for what, v in (("prefix-share", args.prefix_share), ("cancel-rate", args.cancel_rate)):
        if not 0 <= v <= 1:
            raise ValueError(f"--{what} must be within 0..1")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    return WorkloadSpec(
        classes=classes,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_groups=args.prefix_groups,
        prefix_len=args.prefix_len,
        prefix_share=args.prefix_share,
        cancel_rate=args.cancel_rate,
        cancel_after=args.cancel_after,
        burstiness=args.burstiness,
        seed=args.seed,
    )


@contextlib.contextmanager
def _targets(args: argparse.Namespace) -> Iterator[LocalTargets]:
    extra = dict(args.header)
    if args.fleet:
        opts = FleetOptions(
            profile=args.profile,
            workers=args.workers,
            gateways=args.gateways,
            share_port=args.share_port,
            engine_url=args.engine,
            model=args.model,
            litellm=args.litellm,
            sim_args=tuple(args.sim_arg),
        )
        with local_fleet(opts) as local:
            local.targets = [_with_headers(t, extra) for t in local.targets] + [
                _with_headers(t, extra) for t in args.target
            ]
            if args.engine_metrics:
                local.engine_metrics = args.engine_metrics
            yield local
        return
    yield LocalTargets(
        targets=[_with_headers(t, extra) for t in args.target],
        engine_metrics=args.engine_metrics or "",
        meta={"mode": "targets"},
    )


def _with_headers(t: Target, extra: dict[str, str]) -> Target:
    return Target(name=t.name, url=t.url, key=t.key, model=t.model, headers={**t.headers, **extra})


def _git_rev() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    cfg = _sweep_config(args, parser)
    points = schedules(cfg)
    if args.save_trace:
        write_trace(args.save_trace, points[0][1])
    out = Path(args.out or Path("bench/out") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    with _targets(args) as local:
        names = [t.name for t in local.targets]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must be unique: {names}")
        baseline = args.baseline or ("direct" if "direct" in names else None)
        if baseline is not None and baseline not in names:
            raise ValueError(f"--baseline {baseline!r} is not a target ({', '.join(names)})")
        total = sum(len(s) for _, s in points) * len(local.targets)
        bar = ProgressBar(total, enabled=not args.quiet)
        try:
            records = run_sweep(
                cfg,
                local.targets,
                baseline=baseline,
                engine_metrics=local.engine_metrics or None,
                progress=bar,
                processes=local.processes,
            )
        finally:
            bar.close()
        meta = _meta(args, argv, local, cfg)
    workload_meta: dict[str, Any] = (
        {"trace": args.trace, "requests": len(cfg.trace)}
        if cfg.trace is not None
        else cfg.workload.describe()
    )
    res = build_results(
        records,
        targets=[t.public() for t in local.targets],
        baseline=baseline,
        slo=cfg.slo.describe(),
        slo_target=args.slo_target,
        max_lag=args.max_lag,
        workload=workload_meta,
        meta=meta,
    )
    _write(res, records, out, args)
    return 0


def _sweep_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SweepConfig:
    """The run's flags as a sweep; usage errors exit as argparse's do."""
    if not args.fleet and not args.target:
        parser.error("give --target NAME=URL (repeatable) or --fleet")
    if args.rate and args.sweep:
        parser.error("--rate and --sweep exclude each other")
    rates = args.sweep or args.rate
    trace = read_trace(args.trace) if args.trace else None
    if rates is None and trace is None:
        parser.error("give --rate R, --sweep R1,R2,... or --trace FILE")
    return SweepConfig(
        workload=_workload(args),
        rates=rates,
        duration=None if args.num_requests else args.duration,
        count=args.num_requests,
        trace=trace,
        slo=parse_slo(args.slo),
        slo_target=args.slo_target,
        max_lag=args.max_lag,
        model=args.model,
        api=args.api,
        ignore_eos=args.ignore_eos,
        class_header=args.class_header,
        request_timeout=args.request_timeout,
        drain=args.drain,
        cooldown=args.cooldown,
        conns_per_client=args.conns_per_client,
        max_clients=args.max_clients,
        warmup=args.warmup,
        wait_quiet=args.wait_quiet,
        wait_quiet_max=args.wait_quiet_max,
        max_other=args.max_other,
        retries=args.retries,
        in_process=args.in_process,
    )


def _write(res: Results, records: list[RunRecord], out: Path, args: argparse.Namespace) -> None:
    write_json(res, out / "results.json")
    if args.save_raw:
        write_raw(records, out / "raw.jsonl.gz")
    names_png = _plots(res, out, args.no_plots)
    (out / "summary.md").write_text(markdown(res, names_png))
    _print_summary(res, out)


def _meta(
    args: argparse.Namespace, argv: list[str], local: LocalTargets, cfg: SweepConfig
) -> dict[str, Any]:
    point = (
        f"{cfg.count} requests" if cfg.count else f"{cfg.duration:g} s of arrivals"
    ) + f", drain <= {cfg.drain:g} s, request timeout {cfg.request_timeout:g} s"
    meta: dict[str, Any] = {
        "title": args.title,
        "command": "jetserve bench " + shlex.join(argv[1:] if argv[:1] == ["run"] else argv),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "git": _git_rev(),
        "point": point,
        **local.meta,
    }
    return meta


def _print_summary(res: Results, out: Path) -> None:
    print(f"results: {out / 'results.json'}\nsummary: {out / 'summary.md'}")
    for name in res.target_names():
        cap = res.capacity[name]
        high = (
            ""
            if cap.highest_held in (None, cap.max_rate)
            else (f"; held at {fmt_rate(cap.highest_held or 0)} req/s too")
        )
        if cap.max_rate is None:
            print(f"  {name}: max rate under SLO: none (the lowest rate failed){high}")
        else:
            held = " (every rate held)" if cap.all_held else ""
            print(f"  {name}: max rate under SLO: {fmt_rate(cap.max_rate)} req/s{held}{high}")
    for h in res.headline:

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:+.1f} ms"

        print(
            f"  {h.target} vs {h.baseline} @ {fmt_rate(h.light_rate)} req/s: added TTFT "
            f"p50 {ms(h.added_ttft_p50_light)}, p99 {ms(h.added_ttft_p99_light)}"
        )
    behind = [f"{e.target}@{fmt_rate(e.rate)}" for e in res.runs if e.summary.generator.behind]
    if behind:
        print(f"  WARNING: the load generator fell behind in: {', '.join(behind)}")

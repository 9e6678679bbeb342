"""`jetserve bench ...`: argument parsing and the three commands.

jetserve bench [run] --fleet --sweep 2,4,8 --slo ttft=300ms --slo tpot=50ms
jetserve bench [run] --target vllm=http://127.0.0.1:8000/v1 --target gw=URL,key=K --rate 4
jetserve bench plan --results bench/out/.../results.json --peak-rate 40
jetserve bench report --results bench/out/.../results.json   (re-render md and plots)
"""

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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jetserve.bench import plots
from jetserve.bench.dists import parse_dist
from jetserve.bench.fleet_targets import FleetOptions, LocalTargets, local_fleet
from jetserve.bench.metrics import DEFAULT_MAX_LAG
from jetserve.bench.plan import capacity_plan, render
from jetserve.bench.progress import ProgressBar
from jetserve.bench.report import (
    Results,
    build_results,
    derive,
    load_results,
    markdown,
    write_json,
    write_raw,
)
from jetserve.bench.slo import parse_slo
from jetserve.bench.sweep import SweepConfig, run_sweep, schedules
from jetserve.bench.targets import Target, parse_header, parse_target
from jetserve.bench.trace import read_trace, write_trace
from jetserve.bench.units import fmt_rate, parse_duration, parse_rates
from jetserve.bench.workload import ClassSpec, WorkloadSpec, parse_class

COMMANDS = ("run", "plan", "report", "fleet")


def _typed(fn: Any, what: str) -> Any:
    """An argparse `type=` that reports a ValueError as a usage error."""

    def parse(text: str) -> Any:
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{what}: {exc}") from None

    parse.__name__ = what
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetserve bench",
        description="Open-loop benchmarks of OpenAI-compatible targets, side by side.",
        allow_abbrev=False,
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser(
        "fleet",
        allow_abbrev=False,
        help="fleet-routing scenarios on real fleets: affinity, saturation, failover, hedging",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    f.add_argument("--scenario", default="affinity,saturation,failover,hedging")
    f.add_argument("--out", default="bench/results/fleet")
    f.add_argument("--rate", type=float, default=12.0, help="req/s (affinity, failover, hedging)")
    f.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    f.add_argument("--seed", type=int, default=1)
    r = sub.add_parser(
        "run",
        allow_abbrev=False,
        help="run a workload against targets (the default command)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = r.add_argument_group("targets")
    g.add_argument(
        "--target",
        action="append",
        default=[],
        type=_typed(parse_target, "target"),
        metavar="NAME=URL[,key=K][,model=M]",
        help="an OpenAI base URL (repeatable); each runs the same workload",
    )
    g.add_argument("--fleet", action="store_true", help="start a fleet: direct, jetserve, litellm")
    g.add_argument("--profile", default="h100-8b", help="--fleet: simulator profile")
    g.add_argument("--workers", type=int, default=2, help="--fleet: workers")
    g.add_argument("--gateways", type=int, default=1, help="--fleet: gateway replicas")
    g.add_argument(
        "--litellm",
        choices=["auto", "yes", "install", "no"],
        default="auto",
        help="--fleet: LiteLLM peer (auto: when installed)",
    )
    g.add_argument("--sim-arg", action="append", default=[], help="--fleet: extra simulator flag")
    g.add_argument(
        "--baseline", default=None, help="added latency vs this target (default: direct)"
    )
    g.add_argument(
        "--engine-metrics", default=None, help="vLLM /metrics URL: wait idle between runs"
    )

    g = r.add_argument_group("load")
    g.add_argument("--rate", type=_typed(parse_rates, "rate"), default=None, help="req/s")
    g.add_argument("--sweep", type=_typed(parse_rates, "sweep"), default=None, help="req/s list")
    g.add_argument(
        "--duration",
        type=_typed(parse_duration, "duration"),
        default=30.0,
        help="arrivals per point (s)",
    )
    g.add_argument(
        "--num-requests", type=int, default=None, help="per point, instead of --duration"
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--trace", default=None, help="replay this JSONL trace (see docs/bench.md)")
    g.add_argument("--save-trace", default=None, help="write the generated workload as a trace")
    g.add_argument("--seed", type=int, default=0)

    g = r.add_argument_group("workload")
    g.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        type=_typed(parse_class, "class"),
        metavar="NAME=WEIGHT[,in=DIST][,out=DIST]",
        help="request class mix (repeatable; default interactive=1)",
    )
    g.add_argument(
        "--input-len",
        type=_typed(parse_dist, "input-len"),
        default=parse_dist("256"),
        help="prompt tokens: N, uniform:LO:HI, normal:MEAN:SD, lognormal:MEDIAN:SIGMA",
    )
    g.add_argument("--output-len", type=_typed(parse_dist, "output-len"), default=parse_dist("128"))
    g.add_argument("--prefix-groups", type=int, default=0, help="shared-prefix groups")
    g.add_argument("--prefix-len", type=int, default=0, help="tokens each group shares")
    g.add_argument("--prefix-share", type=float, default=0.0, help="fraction in a group")
    g.add_argument("--cancel-rate", type=float, default=0.0, help="fraction the client cancels")
    g.add_argument(
        "--cancel-after",
        type=_typed(parse_dist, "cancel-after"),
        default=parse_dist("uniform:0.1:1.0"),
        help="seconds after sending",
    )
    g.add_argument("--model", default="sim-8b")
    g.add_argument("--api", choices=["chat", "completions"], default="chat")
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send vLLM's ignore_eos (outputs may end early)",
    )
    g.add_argument(
        "--header",
        action="append",
        default=[],
        type=_typed(parse_header, "header"),
        metavar="'NAME: VALUE'",
        help="sent with every request (repeatable)",
    )
    g.add_argument("--class-header", default="X-Jetserve-Class", help="'' to send none")

    g = r.add_argument_group("objectives")
    g.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="ttft|tpot|e2e=DURATION",
        help="e.g. ttft=200ms (repeatable); a bare number is ms",
    )
    g.add_argument("--slo-target", type=float, default=0.9, help="attainment a rate must keep")

    g = r.add_argument_group("generator")
    g.add_argument(
        "--max-lag",
        type=_typed(parse_duration, "max-lag"),
        default=DEFAULT_MAX_LAG,
        help="flag a run whose p99 send lag exceeds this",
    )
    g.add_argument(
        "--request-timeout", type=_typed(parse_duration, "request-timeout"), default=60.0
    )
    g.add_argument(
        "--drain",
        type=_typed(parse_duration, "drain"),
        default=30.0,
        help="after the last arrival, cut open requests",
    )
    g.add_argument("--cooldown", type=_typed(parse_duration, "cooldown"), default=2.0)
    g.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each run")
    g.add_argument("--conns-per-client", type=int, default=10)
    g.add_argument("--max-clients", type=int, default=200)
    g.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="CORES",
        help="before each run, wait until other processes use <= CORES (a shared machine)",
    )
    g.add_argument(
        "--wait-quiet-max",
        type=_typed(parse_duration, "wait-quiet-max"),
        default=120.0,
        help="... for at most this long",
    )
    g.add_argument(
        "--max-other",
        type=float,
        default=0.0,
        metavar="CORES",
        help="run a point again when other processes took more than CORES during it",
    )
    g.add_argument("--retries", type=int, default=2, help="... at most this many times")
    g.add_argument("--in-process", action="store_true", help="no generator subprocess (debug)")

    g = r.add_argument_group("output")
    g.add_argument("--out", default=None, help="results directory (default bench/out/<time>)")
    g.add_argument("--title", default=None)
    g.add_argument("--save-raw", action="store_true", help="also raw.jsonl.gz: every timeline")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress bar")

    pl = sub.add_parser("plan", allow_abbrev=False, help="replicas for a peak load, from a run")
    pl.add_argument("--results", required=True, help="a results.json")
    pl.add_argument("--target", default=None, help="default: jetserve, else the first non-baseline")
    pl.add_argument("--peak-rate", type=float, default=None, help="lambda_peak, req/s")
    pl.add_argument("--rho-max", type=float, default=0.8, help="target utilisation")
    pl.add_argument("--replicas", type=int, default=None, help="engine replicas during the run")

    rp = sub.add_parser("report", allow_abbrev=False, help="re-render markdown and plots")
    rp.add_argument("--results", required=True)
    rp.add_argument("--out", default=None, help="default: the results file's directory")
    rp.add_argument("--no-plots", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] not in (*COMMANDS, "-h", "--help"):
        args_list.insert(0, "run")  # `run` is the default command
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "fleet":
            return cmd_fleet(args)
        return cmd_run(args, parser, args_list)
    except ValueError as exc:
        print(f"jetserve bench: {exc}", file=sys.stderr)
        return 2


def cmd_fleet(args: argparse.Namespace) -> int:
    import asyncio

    from jetserve.bench.fleet_plots import write_fleet_plots
    from jetserve.bench.fleet_scenarios import SCENARIOS, Options, render, run_all

    wanted = tuple(s.strip() for s in args.scenario.split(",") if s.strip())
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    opts = Options(
        scenarios=wanted, out=Path(args.out), seed=args.seed, rate=args.rate,
        duration=args.duration,
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
    if not args.fleet and not args.target:
        parser.error("give --target NAME=URL (repeatable) or --fleet")
    if args.rate and args.sweep:
        parser.error("--rate and --sweep exclude each other")
    rates = args.sweep or args.rate
    trace = read_trace(args.trace) if args.trace else None
    if rates is None and trace is None:
        parser.error("give --rate R, --sweep R1,R2,... or --trace FILE")
    workload = _workload(args)
    slo = parse_slo(args.slo)
    cfg = SweepConfig(
        workload=workload,
        rates=rates,
        duration=None if args.num_requests else args.duration,
        count=args.num_requests,
        trace=trace,
        slo=slo,
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
        {"trace": args.trace, "requests": len(trace)} if trace is not None else workload.describe()
    )
    res = build_results(
        records,
        targets=[t.public() for t in local.targets],
        baseline=baseline,
        slo=slo.describe(),
        slo_target=args.slo_target,
        max_lag=args.max_lag,
        workload=workload_meta,
        meta=meta,
    )
    write_json(res, out / "results.json")
    if args.save_raw:
        write_raw(records, out / "raw.jsonl.gz")
    names_png = _plots(res, out, args.no_plots)
    (out / "summary.md").write_text(markdown(res, names_png))
    _print_summary(res, out)
    return 0


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

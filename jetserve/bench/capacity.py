"""`jetserve bench capacity`: how many requests per second each target completes,
and what CPU each component spends per request, on the fleet `--fleet` starts.

For each concurrency level (low to high) the targets take turns (their order
rotates from one level to the next, as the sweep's do), each driven by a closed
loop (``closedloop.py``) of C clients in a process of its own. The CPU time of
every process group is read from /proc at the moments the measured window opens
and closes. The figures are ``capacity_stats.py``'s; the output
``capacity_report.py``'s.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TextIO

import msgspec
import uvloop

from jetserve.bench.capacity_report import write_outputs
from jetserve.bench.capacity_stats import Level, aggregate, build, components, parse_levels
from jetserve.bench.closedloop import ClosedJob, ClosedResult, run_closed, run_closed_in_subprocess
from jetserve.bench.commands import _git_rev
from jetserve.bench.cpu import CpuMeter
from jetserve.bench.fleet.targets import FleetOptions, LocalTargets, local_fleet
from jetserve.bench.progress import ProgressBar, _clock_text
from jetserve.bench.prompts import Api
from jetserve.bench.sweep import run_salt, wait_idle
from jetserve.bench.targets import Target
from jetserve.bench.units import parse_duration

IDLE_TIMEOUT_S = 60.0


class CapacityConfig(msgspec.Struct, kw_only=True):
    levels: list[int]
    duration: float = 10.0  # measured seconds per level
    warmup: float = 1.0  # clients run this long before the window opens
    cooldown: float = 1.0  # pause between runs, after the engine went idle
    stream: bool = True
    input_tokens: int = 64
    max_tokens: int = 16
    model: str = "sim-8b"
    api: Api = "chat"
    ignore_eos: bool = True
    seed: int = 0
    request_timeout: float = 60.0
    in_process: bool = False  # the generator in this process (debugging)


def _typed_levels(text: str) -> list[int]:
    try:
        return parse_levels(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _typed_duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=_typed_levels, default="4,16,32", metavar="C1,C2,...",
                   help="closed-loop clients per level")  # fmt: skip
    g.add_argument("--duration", type=_typed_duration, default=10.0, help="measured s per level")
    g.add_argument("--warmup", type=_typed_duration, default=1.0, help="s before the window")
    g.add_argument("--cooldown", type=_typed_duration, default=1.0, help="s between runs")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="SSE streams (TTFT measured too), or whole responses")  # fmt: skip
    g.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    g.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    g.add_argument("--api", choices=["chat", "completions"], default="chat", help="endpoint")
    g.add_argument("--model", default="sim-8b", help="model name")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send vLLM's ignore_eos (outputs may end early)")  # fmt: skip
    g.add_argument("--request-timeout", type=_typed_duration, default=60.0, help="s")
    g.add_argument("--seed", type=int, default=0, help="prompt words")
    f = p.add_argument_group("fleet")
    f.add_argument("--profile", default="fast", help="simulator profile (fast: zero latency)")
    f.add_argument("--workers", type=int, default=2, help="jetserve workers")
    f.add_argument("--gateways", type=int, default=1, help="jetserve gateway replicas")
    f.add_argument("--share-port", action="store_true",
                   help="the gateways bind one port with SO_REUSEPORT")  # fmt: skip
    f.add_argument("--engine", default=None, metavar="URL",
                   help="a running OpenAI-compatible engine instead of the simulator")  # fmt: skip
    f.add_argument("--litellm", choices=["auto", "yes", "install", "no"], default="auto",
                   help="LiteLLM peer (auto: when installed)")  # fmt: skip
    f.add_argument("--sim-arg", action="append", default=[], help="extra simulator flag")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="default bench/out/capacity-<time>")
    o.add_argument("--no-plots", action="store_true", help="no PNGs")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--in-process", action="store_true", help="no generator subprocess (debug)")


class CapacityBar(ProgressBar):
    """The progress bar over time: one tick a tenth of a measured second, with the
    requests completed in the current window."""

    TICK = 0.1

    def __init__(
        self,
        runs: int,
        duration: float,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ) -> None:
        self.per_run = max(round(duration / self.TICK), 1)
        self.duration = duration
        self.requests = 0
        super().__init__(runs * self.per_run, stream, enabled=enabled, tty=tty)

    def start(self, label: str) -> None:
        self.requests = 0
        self.start_run(label, self.per_run)

    def window(self, elapsed: float, done: int, bad: int) -> None:
        self.requests = done
        ticks = min(round(elapsed / self.TICK), self.per_run)
        self.update(ticks, ticks, bad)

    def render(self) -> str:
        ticks, _, bad = self._state
        frac = min((self._finished + ticks) / self.total, 1.0)
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = self._clock() - self._start
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        return (
            f"[{bar}] {frac * 100:3.0f}% {self._label}  {ticks * self.TICK:.1f}/"
            f"{self.duration:g}s done {self.requests} bad {bad}  {_clock_text(elapsed)}"
            f" (eta {_clock_text(eta)})"
        )


def _say(text: str) -> None:
    print(f"jetserve bench: {text}", file=sys.stderr, flush=True)


def measure(
    cfg: CapacityConfig, target: Target, level: int, local: LocalTargets, bar: CapacityBar
) -> Level:
    """One target at one concurrency level."""
    if local.engine_metrics and not wait_idle(local.engine_metrics, IDLE_TIMEOUT_S):
        _say(f"engine still busy after {IDLE_TIMEOUT_S:g}s; starting anyway")
    time.sleep(cfg.cooldown)
    job = ClosedJob(
        target=target,
        concurrency=level,
        duration=cfg.duration,
        warmup=cfg.warmup,
        stream=cfg.stream,
        input_tokens=cfg.input_tokens,
        max_tokens=cfg.max_tokens,
        model=cfg.model,
        api=cfg.api,
        ignore_eos=cfg.ignore_eos,
        salt=run_salt(cfg.seed, float(level), f"capacity:{target.name}"),
        seed=cfg.seed,
        request_timeout=cfg.request_timeout,
    )
    samples: dict[str, dict[str, float]] = {}

    def mark(name: str, pid: int | None) -> None:
        groups = dict(local.processes)
        if pid is not None:
            groups["generator"] = [pid]  # alive, so not yet in this process's own times
        samples[name] = CpuMeter(groups).sample()

    bar.start(f"{target.name} C={level}")
    result: ClosedResult
    if cfg.in_process:
        result = uvloop.run(run_closed(job, lambda name: mark(name, None), bar.window))
    else:
        result = run_closed_in_subprocess(job, mark, bar.window)
    bar.end_run()
    cpu: dict[str, float] = {}
    if "begin" in samples and "end" in samples:
        cpu = CpuMeter.delta(samples["begin"], samples["end"])
        if cpu and cfg.in_process:
            cpu["generator"] = round(result.cpu_s, 3)
    cpu_path = local.meta.get("cpu_path")
    serving = components(target.name, cpu_path if isinstance(cpu_path, dict) else {})
    return aggregate(
        target.name, level, result.timelines, result.window, cpu, serving,
        stream=cfg.stream, clients=result.clients, unfinished=result.unfinished,
    )  # fmt: skip


def run_levels(cfg: CapacityConfig, local: LocalTargets, bar: CapacityBar) -> list[Level]:
    """Every level, low to high; at each the targets take turns, in rotating order.
    Returned per target (in the targets' order), then per level."""
    targets = local.targets
    by_key: dict[tuple[str, int], Level] = {}
    for n, level in enumerate(cfg.levels):
        k = n % len(targets)
        for target in targets[k:] + targets[:k]:
            by_key[(target.name, level)] = measure(cfg, target, level, local, bar)
    return [by_key[(t.name, lv)] for t in targets for lv in cfg.levels]


def _config(args: argparse.Namespace) -> CapacityConfig:
    if args.max_tokens < 1 or args.input_len < 2:
        raise ValueError("--max-tokens must be >= 1 and --input-len >= 2")
    if args.duration <= 0:
        raise ValueError("--duration must be > 0")
    return CapacityConfig(
        levels=args.concurrency,
        duration=args.duration,
        warmup=args.warmup,
        cooldown=args.cooldown,
        stream=args.stream,
        input_tokens=args.input_len,
        max_tokens=args.max_tokens,
        model=args.model,
        api=args.api,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        request_timeout=args.request_timeout,
        in_process=args.in_process,
    )


def _meta(argv: list[str], local: LocalTargets) -> dict[str, object]:
    return {
        "command": "jetserve bench " + shlex.join(argv),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)),
            "arch": platform.machine(),
            "python": platform.python_version(),
        },
        "git": _git_rev(),
        **local.meta,
    }


def cmd_capacity(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = _config(args)
    out = Path(args.out or Path("bench/out") / time.strftime("capacity-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
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
        runs = len(cfg.levels) * len(local.targets)
        bar = CapacityBar(runs, cfg.duration, enabled=not args.quiet)
        try:
            levels = run_levels(cfg, local, bar)
        finally:
            bar.close()
        meta = _meta(argv, local)
        targets = [t.public() for t in local.targets]
    config = {
        **msgspec.to_builtins(cfg),
        "profile": args.profile,
        "workers": args.workers,
        "gateways": args.gateways,
        "share_port": args.share_port,
        "engine": args.engine,
    }
    res = build(levels, meta=meta, config=config, targets=targets)
    for line in write_outputs(res, out, plots_wanted=not args.no_plots):
        print(line)
    return 0

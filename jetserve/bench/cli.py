"""`jetserve bench ...`: argument parsing and dispatch to the four commands
(``commands.py``).

jetserve bench [run] --fleet --sweep 2,4,8 --slo ttft=300ms --slo tpot=50ms
jetserve bench [run] --target vllm=http://127.0.0.1:8000/v1 --target gw=URL,key=K --rate 4
jetserve bench plan --results bench/out/.../results.json --peak-rate 40
jetserve bench report --results bench/out/.../results.json   (re-render md and plots)
jetserve bench fleet --scenario affinity,failover   (the fleet-routing scenarios)
jetserve bench capacity --concurrency 4,16,32   (closed loop: max req/s, CPU per request)
jetserve bench idle --duration 30   (what an idle fleet costs, per process)
jetserve bench embed   (real MiniLM on vLLM: direct vs through jetserve, batching off/on)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from jetserve.bench.capacity import add_arguments as add_capacity_arguments
from jetserve.bench.capacity import cmd_capacity
from jetserve.bench.commands import cmd_fleet, cmd_plan, cmd_report, cmd_run
from jetserve.bench.dists import parse_dist
from jetserve.bench.embed import add_arguments as add_embed_arguments
from jetserve.bench.embed import cmd_embed
from jetserve.bench.idle import add_arguments as add_idle_arguments
from jetserve.bench.idle import cmd_idle
from jetserve.bench.metrics import DEFAULT_MAX_LAG
from jetserve.bench.targets import parse_header, parse_target
from jetserve.bench.units import parse_duration, parse_rates
from jetserve.bench.workload import parse_class

COMMANDS = ("run", "plan", "report", "fleet", "capacity", "idle", "embed")

T = TypeVar("T")


def _typed(fn: Callable[[str], T], what: str) -> Callable[[str], T]:
    """An argparse `type=` that reports a ValueError as a usage error."""

    def parse(text: str) -> T:
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
        help="fleet scenarios on real fleets: affinity, saturation, failover, hedging, soak, "
        "fairness, scale, rollout",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    f.add_argument("--scenario", default="affinity,saturation,failover,hedging")
    f.add_argument("--out", default="bench/results/fleet")
    f.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="scale and kvindex: the fleet's replicas (0: 64 for scale, 16 for kvindex)",
    )
    f.add_argument(
        "--rate", type=float, default=12.0, help="req/s (affinity, failover, hedging, soak)"
    )
    f.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    f.add_argument(
        "--warmup",
        type=float,
        default=120.0,
        help="scale: seconds of the same load before the measured --duration "
        "(the lane balance waits for ~10 starts a replica, then settles over a minute)",
    )
    f.add_argument(
        "--lanes",
        type=int,
        default=0,
        help="scale and kvindex: interactive lanes (0: the product's default, 256)",
    )
    f.add_argument(
        "--lane-load-factor",
        type=float,
        default=0.0,
        help="scale and kvindex: the gateway's --lane-load-factor (0: the default, 1.4)",
    )
    f.add_argument("--seed", type=int, default=1)
    r = sub.add_parser(
        "run",
        allow_abbrev=False,
        help="run a workload against targets (the default command)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, add in RUN_GROUPS:
        add(r.add_argument_group(name))
    pl = sub.add_parser("plan", allow_abbrev=False, help="replicas for a peak load, from a run")
    pl.add_argument("--results", required=True, help="a results.json")
    pl.add_argument("--target", default=None, help="default: jetserve, else the first non-baseline")
    pl.add_argument("--peak-rate", type=float, default=None, help="lambda_peak, req/s")
    pl.add_argument("--rho-max", type=float, default=0.8, help="target utilisation")
    pl.add_argument("--replicas", type=int, default=None, help="engine replicas during the run")

    cap = sub.add_parser(
        "capacity",
        allow_abbrev=False,
        help="closed loop on a fleet: max req/s and CPU per request, per target",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_capacity_arguments(cap)
    idle = sub.add_parser(
        "idle",
        allow_abbrev=False,
        help="an idle fleet's CPU, per process",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_idle_arguments(idle)
    emb = sub.add_parser(
        "embed",
        allow_abbrev=False,
        help="embeddings on a real MiniLM (vLLM): direct vs through jetserve",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_embed_arguments(emb)
    rp = sub.add_parser("report", allow_abbrev=False, help="re-render markdown and plots")
    rp.add_argument("--results", required=True)
    rp.add_argument("--out", default=None, help="default: the results file's directory")
    rp.add_argument("--no-plots", action="store_true")
    return p


def _targets_options(g: argparse._ArgumentGroup) -> None:
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
    g.add_argument("--share-port", action="store_true", help="--fleet: the gateways bind one port")
    g.add_argument(
        "--engine",
        default=None,
        metavar="URL",
        help="--fleet: a running OpenAI-compatible engine instead of the simulator",
    )
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


def _load_options(g: argparse._ArgumentGroup) -> None:
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


def _workload_options(g: argparse._ArgumentGroup) -> None:
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


def _objectives_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="ttft|tpot|e2e=DURATION",
        help="e.g. ttft=200ms (repeatable); a bare number is ms",
    )
    g.add_argument("--slo-target", type=float, default=0.9, help="attainment a rate must keep")


def _generator_options(g: argparse._ArgumentGroup) -> None:
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


def _output_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--out", default=None, help="results directory (default bench/out/<time>)")
    g.add_argument("--title", default=None)
    g.add_argument("--save-raw", action="store_true", help="also raw.jsonl.gz: every timeline")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


RUN_GROUPS: tuple[tuple[str, Callable[[argparse._ArgumentGroup], None]], ...] = (
    ("targets", _targets_options),
    ("load", _load_options),
    ("workload", _workload_options),
    ("objectives", _objectives_options),
    ("generator", _generator_options),
    ("output", _output_options),
)


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
        if args.command == "capacity":
            return cmd_capacity(args, args_list)
        if args.command == "idle":
            return cmd_idle(args, args_list)
        if args.command == "embed":
            return cmd_embed(args, args_list)
        return cmd_run(args, parser, args_list)
    except ValueError as exc:
        print(f"jetserve bench: {exc}", file=sys.stderr)
        return 2

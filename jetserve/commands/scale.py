"""``jetserve scale``: queue lag per class and the worker count KEDA will choose
(the arithmetic and the reading of the lag: ``jetserve/scale.py``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from jetserve.commands.common import DEFAULT_NATS, add_bus_args, bus_auth
from jetserve.scale import (
    OptionError,
    ScaleError,
    jsz_url,
    lags_from_monitoring,
    lags_from_nats,
    policies,
    report,
)
from streams.auth import Role
from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import RequestClass

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers

PER_CLASS = "N or CLASS=N, comma-separated, repeatable"


def register(sub: Subparsers) -> None:
    sc = sub.add_parser(
        "scale",
        allow_abbrev=False,
        help="queue lag per class and the worker count KEDA will choose",
    )
    sc.add_argument("--nats", default=DEFAULT_NATS, help="read the consumers through this server")
    add_bus_args(sc)
    sc.add_argument(
        "--monitoring",
        default=None,
        metavar="HOST:PORT",
        help="read /jsz here instead, as KEDA does (its natsServerMonitoringEndpoint)",
    )
    sc.add_argument("--account", default="$G", help="the NATS account /jsz is asked for")
    sc.add_argument("--classes", default="interactive,embed,batch")
    sc.add_argument(
        "--deployment",
        default="",
        help="the workers' deployment (their engine's model by default): its pool's "
        "backlog of each class counts too (read through --nats only)",
    )
    sc.add_argument(
        "--max-inflight", action="append", default=[], help=f"worker concurrency ({PER_CLASS})"
    )
    sc.add_argument(
        "--target-per-worker",
        action="append",
        default=[],
        help=f"KEDA lagThreshold; default: --max-inflight ({PER_CLASS})",
    )
    sc.add_argument(
        "--activation-lag",
        action="append",
        default=[],
        help=f"activationLagThreshold ({PER_CLASS})",
    )
    sc.add_argument(
        "--min-replicas", action="append", default=[], help=f"minReplicaCount ({PER_CLASS})"
    )
    sc.add_argument(
        "--max-replicas", action="append", default=[], help=f"maxReplicaCount ({PER_CLASS})"
    )
    sc.add_argument(
        "--replicas",
        action="append",
        default=[],
        help=f"current replicas, for the HPA's 10%% tolerance ({PER_CLASS})",
    )
    sc.add_argument("--json", action="store_true", help="print JSON (one line per refresh)")
    sc.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh")
    sc.set_defaults(func=run_scale)


def render(rep: dict[str, Any]) -> str:
    head = (
        "class",
        "consumer",
        "pending",
        "ack_pending",
        "lag",
        "per_worker",
        "lagThreshold",
        "activation",
        "min..max",
        "active",
        "desired",
    )
    table = [head]
    for r in rep["classes"]:
        table.append(
            (
                r["class"],
                r["consumer"] if r["consumer_found"] else f"{r['consumer']} (MISSING)",
                str(r["num_pending"]),
                str(r["num_ack_pending"]),
                str(r["lag"]),
                str(r["max_inflight"]),
                str(r["lag_threshold"]),
                str(r["activation_lag_threshold"]),
                f"{r['min_replicas']}..{r['max_replicas']}",
                "yes" if r["active"] else "no",
                str(r["desired_replicas"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rep["time"]))
    lines = [f"jetserve scale  stream {rep['stream']}  via {rep['source']}  at {stamp}", ""]
    for row in table:
        cells = [
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines += [
        "",
        "KEDA nats-jetstream scaler + HPA (AverageValue target = lagThreshold):",
        "  lag     = num_pending + num_ack_pending",
        "  desired = 0, if minReplicaCount == 0 and lag <= activationLagThreshold",
        "          = clamp(ceil(lag / lagThreshold), max(minReplicaCount, 1), maxReplicaCount)",
        "",
    ]
    width = max(len(r["class"]) for r in rep["classes"]) + 1
    lines += [f"  {r['class'] + ':':<{width}} {r['explain']}" for r in rep["classes"]]
    return "\n".join(lines)


async def _once(args: argparse.Namespace, classes: tuple[str, ...]) -> dict[str, Any]:
    topo = DEFAULT_TOPOLOGY
    pols = policies(args, classes)
    if args.monitoring:
        lags = await lags_from_monitoring(args.monitoring, args.account, topo, classes)
        source = jsz_url(args.monitoring, args.account)
    else:
        auth = bus_auth(args, Role.ADMIN)
        lags = await lags_from_nats(args.nats, topo, classes, auth, args.deployment)
        source = f"{args.nats} (JetStream consumer info)"
    return report(lags, pols, source, topo.stream)


async def _run(args: argparse.Namespace, classes: tuple[str, ...]) -> int:
    while True:
        try:
            rep = await _once(args, classes)
        except ScaleError as exc:
            if args.watch is None:
                raise
            print(f"jetserve scale: {exc}", file=sys.stderr, flush=True)
        else:
            if args.json:
                print(json.dumps(rep, indent=None if args.watch else 2), flush=True)
            else:
                print(render(rep) + ("\n" if args.watch else ""), flush=True)
        if args.watch is None:
            return 0
        await asyncio.sleep(args.watch)


def run_scale(args: argparse.Namespace) -> int:
    classes = tuple(c.strip() for c in args.classes.split(",") if c.strip())
    try:
        for cls in classes:
            RequestClass(cls)
    except ValueError:
        print(f"jetserve scale: unknown class in --classes {args.classes!r}", file=sys.stderr)
        return 2
    if args.watch is not None and args.watch <= 0:
        print("jetserve scale: --watch needs a positive number of seconds", file=sys.stderr)
        return 2
    try:
        policies(args, classes)  # option errors before any connection
        return asyncio.run(_run(args, classes))
    except ScaleError as exc:
        print(f"jetserve scale: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, OptionError) else 1
    except KeyboardInterrupt:
        return 0

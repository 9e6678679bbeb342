"""`jetserve bench idle`: what a fleet with nothing to do costs, per process.

It starts the fleet `jetserve up` runs (NATS, Redis, the simulator, a gateway,
workers and, with ``--agents``, agent executors), lets it settle, then reads
every process group's CPU time from /proc at the start and the end of a quiet
window. The figure that counts is the fleet's own (gateway, workers, executors,
NATS, Redis); the simulator stands in for an engine, which is not ours to
count, and is reported beside it. Written to ``idle.json`` and printed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import msgspec

from jetserve.bench.cpu import CpuMeter
from jetserve.fleet import Fleet, FleetSpec

ENGINE_GROUPS = ("sim",)  # stand-ins for engines: reported, not counted


class IdleResult(msgspec.Struct, kw_only=True):
    command: str
    when: str
    window_s: float
    workers: int
    agents: int
    replicas: int = 0  # --replicas: engines behind multi-engine workers, not --workers
    lanes: int = 32  # per lane class (FleetSpec's; --lanes with --replicas)
    lane_load_factor: float = 1.4
    # Per process group: share of one core, in percent, over the window.
    percent_of_a_core: dict[str, float]
    fleet_percent: float  # the fleet's own: every group but the engines
    other_percent: float | None  # what else ran on the machine meanwhile (noise)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds")
    p.add_argument("--settle", type=float, default=10.0, help="seconds before the window")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--agents", type=int, default=1, help="agent executors (jetserve up has 1)")
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="a many-replica fleet instead: N simulated engines, 32 to a simulator "
        "process, 8 to a worker process, --lanes lanes (the scale bench's fleet)",
    )
    p.add_argument("--lanes", type=int, default=256, help="--replicas: lanes per lane class")
    p.add_argument("--lane-load-factor", type=float, default=1.4, help="--replicas: the gateway's")
    p.add_argument("--out", default="bench/results/idle", help="directory for idle.json")


def groups(fleet: Fleet) -> dict[str, list[int]]:
    return {
        "gateway": [g.proc.pid for g in fleet.gateways],
        "worker": [w.proc.pid for w in fleet.workers],
        "agent": [a.proc.pid for a in fleet.agents],
        "nats": [n.proc.pid for n in fleet.nats_nodes],
        "redis": [fleet.redis.proc.pid] if fleet.redis else [],
        "sim": [s.proc.pid for s in (fleet.sim, *fleet.extra_sims) if s is not None],
    }


def measure(fleet: Fleet, window_s: float) -> tuple[dict[str, float], float | None]:
    """Percent of one core per group over ``window_s``, and the machine's rest."""
    meter = CpuMeter(groups(fleet))
    before = meter.sample()
    time.sleep(window_s)  # the measurement itself: nothing to wait on but time
    delta = CpuMeter.delta(before, meter.sample())
    other = delta.pop("other", None)
    pct = {k: round(100 * v / window_s, 2) for k, v in delta.items()}
    return pct, None if other is None else round(100 * other / window_s, 2)


def cmd_idle(args: argparse.Namespace, argv: list[str]) -> int:
    if args.replicas:
        spec = FleetSpec(
            workers=0,
            agents=args.agents,
            profile="h100-8b",
            sim_replicas=args.replicas,
            replicas_per_sim=32,
            engines_per_worker=8,
            lanes=args.lanes,
            gateway_args=["--lane-load-factor", str(args.lane_load_factor)],
        )
    else:
        spec = FleetSpec(workers=args.workers, agents=args.agents)
    with Fleet(spec) as fleet:
        time.sleep(args.settle)  # start-up work (provisioning, first scrapes) passes
        pct, other = measure(fleet, args.duration)
    own = round(sum(v for k, v in pct.items() if k not in ENGINE_GROUPS), 2)
    res = IdleResult(
        command="jetserve bench " + " ".join(argv),
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        window_s=args.duration,
        workers=args.replicas // 8 if args.replicas else args.workers,  # processes
        agents=args.agents,
        replicas=args.replicas,
        lanes=spec.lanes,
        lane_load_factor=args.lane_load_factor if args.replicas else 1.4,
        percent_of_a_core=pct,
        fleet_percent=own,
        other_percent=other,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "idle.json").write_bytes(msgspec.json.format(msgspec.json.encode(res)) + b"\n")
    parts = ", ".join(f"{k} {v}%" for k, v in pct.items())
    print(f"idle fleet: {own}% of a core ({parts}; engines not counted)")
    print(f"wrote {out / 'idle.json'}")
    return 0

"""`jetserve bench fleet`: the fleet-routing scenarios, each on fresh real fleets
(NATS, Redis, gateway, workers, one simulator per replica), each compared with
its own baseline in the same run.

- ``affinity``: 4 replicas, h100-8b profile, many groups sharing long system
  prompts (the groups' prefixes overflow one replica's KV cache but fit the
  fleet's): prefix-cache hit rate and TTFT for affinity vs round-robin vs
  least-loaded routing.
- ``saturation``: offered load at 2x the measured capacity, interactive and
  batch mixed, with deadline-aware shedding on and off: goodput per class,
  explicit rejections (429 ``deadline_unmeetable``) and admission rate.
- ``failover``: a replica (worker and engine) SIGKILLed mid-run: every accepted
  request ends completed or visibly failed, reconciled against the ledger.
- ``hedging``: an engine profile with a heavy first-token tail (5% of requests
  stall 1.5 s): TTFT percentiles with and without hedging, and what it cost;
  then hedging across 3 gateways under a cap tighter than the tail wants
  (2 %): the hedges sent fleet-wide against the cap's bound.
- ``soak``: minutes of ordinary mixed load, no faults (``fleet/soak.py``): no
  accepted request may fail, and the gateway's and workers' RSS stays flat.
  Not in the default set; run it as ``--scenario soak --rate 40 --duration 240``.
- ``fairness``: one tenant floods a class at 5x capacity while another sends a
  tenth of it (``fleet/fairness.py``): the second tenant's TTFT against its own
  alone. Not in the default set.
- ``scale``: 64 replicas on one machine (``fleet/scale.py``): hit share against
  the oracle's, how evenly replicas serve, TTFT against round-robin, and replicas
  joining and leaving mid-run. Not in the default set.
- ``rollout``: a canary on a deployment that fails every request, then one whose
  first tokens come late, each applied under load (``fleet/rollout.py``): the
  time from its revision to the guard's rollback, and the requests it harmed.
  Not in the default set.

Every latency figure is published beside the admission rate it was measured at.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.inference.hedge_budget import BANK_CAP
from jetserve.bench.fleet.client import (
    Driver,
    Fault,
    MakeRequest,
    Shot,
    chat,
    gateway_metric,
    ledger_check,
    summarize,
    system_prompt,
)
from jetserve.bench.fleet.fairness import fairness
from jetserve.bench.fleet.rollout import rollout
from jetserve.bench.fleet.scale import Lanes, scale
from jetserve.bench.fleet.soak import soak
from jetserve.fleet import Fleet, FleetSpec
from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import RequestClass
from workers.inference.admission import AdmissionConfig

SCENARIOS = (
    "affinity",
    "saturation",
    "failover",
    "hedging",
    "soak",
    "fairness",
    "scale",
    "rollout",
    "kvindex",
)
CAPPED_RATIO = 0.02  # hedging's 3-gateway arm: tighter than the 3 % tail wants
BATCH_DEADLINE_S = 20.0  # saturation: batch waits for its share; interactive has 4 s


def _fleet(**kw: Any) -> Fleet:
    return Fleet(FleetSpec(**kw)).start()


async def _run(
    fleet: Fleet,
    seed: int,
    patience: float,
    rate: float,
    duration: float,
    make: MakeRequest,
    during: Fault | None = None,
) -> list[Shot]:
    driver = Driver(fleet, seed, patience)
    try:
        await asyncio.sleep(1.5)  # lane priorities settle after the last worker joined
        return await driver.run(rate, duration, make, during)
    finally:
        await driver.aclose()


# -- the scenarios ---------------------------------------------------------------


async def affinity(opts: Options) -> dict[str, Any]:
    groups, words = opts.groups, opts.prefix_words
    prompts = [system_prompt(g, words) for g in range(groups)]

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        g = rng.randrange(groups)
        return "interactive", chat(prompts[g], f"Request {i}: what applies to case {g}?", 24), {}

    rows = []
    for mode in ("affinity", "round_robin", "least_loaded"):
        fleet = await asyncio.to_thread(
            _fleet,
            workers=4,
            engine_per_worker=True,
            profile="h100-8b",
            sim_args=["--num-gpu-blocks", str(opts.gpu_blocks)],
            gateway_args=["--routing", mode],
        )
        try:
            shots = await _run(fleet, opts.seed, 60.0, opts.rate, opts.duration, make)
        finally:
            await asyncio.to_thread(fleet.stop)
        rows.append(summarize(mode, shots, opts.duration))
    return {
        "scenario": "affinity",
        "setup": {
            "replicas": 4,
            "profile": "h100-8b",
            "gpu_blocks_per_replica": opts.gpu_blocks,
            "kv_tokens_per_replica": opts.gpu_blocks * 16,
            "groups": groups,
            "system_prompt_words": words,
            "rate_rps": opts.rate,
            "duration_s": opts.duration,
        },
        "rows": [asdict(r) for r in rows],
    }


async def saturation(opts: Options) -> dict[str, Any]:
    """Capacity first (the completion rate under overload, shedding off), then 2x it."""
    timeout = opts.deadline_s
    sim = ["--max-num-seqs", "4"]
    worker = ["--max-inflight", "4"]

    def make_cls(mix: float) -> MakeRequest:
        def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
            cls = "interactive" if rng.random() < mix else "batch"
            body = chat(None, f"Request {i}: summarise the ticket queue.", 48)
            # Batch may wait: it is served with the share interactive leaves it.
            deadline = timeout if cls == "interactive" else BATCH_DEADLINE_S
            return cls, body, {"X-Jetserve-Timeout": str(deadline)}

        return make

    fleet = await asyncio.to_thread(
        _fleet,
        workers=2,
        engine_per_worker=True,
        profile="h100-8b",
        sim_args=sim,
        worker_args=worker,
        gateway_args=["--no-shed"],
    )
    try:
        probe = await _run(fleet, opts.seed, timeout + 10, 40.0, 8.0, make_cls(1.0))
    finally:
        await asyncio.to_thread(fleet.stop)
    # Completions per second while the queue was never empty = capacity.
    ends = sorted(s.sent + (s.e2e or 0) for s in probe if s.outcome == "ok")
    capacity = len(ends) / max(ends[-1] - ends[0], 1e-3) if len(ends) > 1 else 1.0
    rate = 2 * capacity
    rows = []
    # The half-batch mix's interactive half, alone at its own rate: the baseline
    # its interactive TTFT is held to (issue 15: class priority, <= 1.3x).
    runs = ((1.0, 1.0, "interactive only"), (1.0, 0.5, "interactive half alone"),
            (0.5, 1.0, "half batch"))  # fmt: skip
    for mix, share, mix_name in runs:
        for shed in (True, False):
            fleet = await asyncio.to_thread(
                _fleet,
                workers=2,
                engine_per_worker=True,
                profile="h100-8b",
                sim_args=sim,
                worker_args=worker,
                gateway_args=[] if shed else ["--no-shed"],
            )
            try:
                shots = await _run(
                    fleet,
                    opts.seed,
                    max(timeout, BATCH_DEADLINE_S) + 10,
                    rate * share,
                    opts.duration,
                    make_cls(mix),
                )
            finally:
                await asyncio.to_thread(fleet.stop)
            name = f"{mix_name}, {'shedding' if shed else 'no shedding'}"
            rows.append(summarize(name, shots, opts.duration))
            if mix < 1.0:
                for cls in ("interactive", "batch"):
                    part = [s for s in shots if s.cls == cls]
                    rows.append(summarize(f"  {cls}", part, opts.duration))
    return {
        "scenario": "saturation",
        "setup": {
            "replicas": 2,
            "max_num_seqs": 4,
            "deadline_s": timeout,
            "batch_deadline_s": BATCH_DEADLINE_S,
            "lower_share": AdmissionConfig.lower_share,
            "capacity_rps": round(capacity, 2),
            "offered_rps": round(rate, 2),
            "mixes": "interactive only; its half alone (half the rate); 50% interactive, 50% batch",
            "duration_s": opts.duration,
        },
        "rows": [asdict(r) for r in rows],
    }


async def failover(opts: Options) -> dict[str, Any]:
    prompts = [system_prompt(g, 400) for g in range(16)]

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        g = rng.randrange(len(prompts))
        body = chat(prompts[g], f"Request {i} for team {g}.", 48)
        return "interactive", body, {"X-Jetserve-Timeout": "20"}

    fleet = await asyncio.to_thread(_fleet, workers=4, engine_per_worker=True, profile="h100-8b")
    killed: dict[str, Any] = {}

    async def kill_one() -> None:
        await asyncio.sleep(opts.duration / 2)
        killed["at_s"] = round(opts.duration / 2, 1)
        killed["worker"] = fleet.workers[1].name
        fleet.workers[1].kill()
        sim = fleet.worker_sims[1]
        if sim is not None:
            sim.kill()

    try:
        shots = await _run(fleet, opts.seed, 40.0, opts.rate, opts.duration, make, during=kill_one)
        ledger = await ledger_check(fleet, shots)
    finally:
        await asyncio.to_thread(fleet.stop)
    row = summarize("replica killed mid-run", shots, opts.duration)
    return {
        "scenario": "failover",
        "setup": {"replicas": 4, "rate_rps": opts.rate, "duration_s": opts.duration, **killed},
        "ledger": ledger,
        "rows": [asdict(row)],
    }


async def hedging(opts: Options) -> dict[str, Any]:
    tail = ["--fault-rate", "stall:1500=0.03"]

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        return "interactive", chat(None, f"Request {i}: a quick answer please.", 16), {}

    rows = []
    extra: dict[str, Any] = {}
    # (hedge cap or None: no hedging, gateways): the third arm's cap binds.
    arms = ((None, 1), (0.1, 1), (CAPPED_RATIO, 3))
    for cap, gateways in arms:
        hedge = cap is not None
        fleet = await asyncio.to_thread(
            _fleet,
            workers=4,
            gateways=gateways,
            engine_per_worker=True,
            profile="h100-8b",
            sim_args=tail,
            gateway_args=["--hedge", "p95", "--hedge-max-extra", str(cap)] if hedge else [],
        )
        try:
            shots = await _run(fleet, opts.seed, 30.0, opts.rate, opts.duration, make)
            hedges = await asyncio.to_thread(gateway_metric, fleet, "jetserve_gateway_hedges_total")
        finally:
            await asyncio.to_thread(fleet.stop)
        by_outcome: Counter[str] = Counter()
        for labels, value in hedges.items():
            m = re.search(r'outcome="(\w+)"', labels)
            if m:
                by_outcome[m.group(1)] += int(value)
        sent = by_outcome.get("sent", 0)
        name = "hedging (p95)" if hedge else "no hedging"
        if gateways > 1:
            name = f"hedging (p95), {gateways} gateways, cap {cap:.0%}"
        extra = {
            "hedges": dict(by_outcome),
            "extra_attempts": sent,
            "extra_attempt_ratio": round(sent / max(len(shots), 1), 3),
        }
        if hedge:
            # hedge_budget.py's guarantee: earned credit plus one bank's worth.
            extra["cap_bound"] = round(float(cap or 0) * len(shots) + BANK_CAP, 1)
        rows.append(summarize(name, shots, opts.duration, **extra))
    return {
        "scenario": "hedging",
        "setup": {
            "replicas": 4,
            "profile": "h100-8b",
            "tail": "3% of requests: first token delayed 1.5 s (simulator stall:1500)",
            "hedge_cap": f"10% of requests; {CAPPED_RATIO:.0%} on 3 gateways",
            "rate_rps": opts.rate,
            "duration_s": opts.duration,
        },
        "rows": [asdict(r) for r in rows],
    }


@dataclass(frozen=True)
class Options:
    scenarios: tuple[str, ...] = SCENARIOS
    out: Path = Path("bench/results/fleet")
    seed: int = 1
    rate: float = 12.0
    duration: float = 30.0
    groups: int = 32
    prefix_words: int = 600
    gpu_blocks: int = 1024
    deadline_s: float = 4.0
    replicas: int = 0  # scale, kvindex: the fleet's replicas (0: 64, 16)
    warmup: float = 0.0  # scale: seconds of load before the measured duration
    lanes: int = 0  # scale, kvindex: interactive lanes (0: the product's default)
    lane_load_factor: float = 0.0  # scale, kvindex: 0: the product's default


async def soak_run(opts: Options) -> dict[str, Any]:
    return await soak(opts.rate, opts.duration, opts.seed)


async def fairness_run(opts: Options) -> dict[str, Any]:
    return await fairness(opts.seed, opts.duration)


def _lanes(opts: Options) -> Lanes:
    return Lanes(
        opts.lanes or DEFAULT_TOPOLOGY.lanes_of(RequestClass.INTERACTIVE),
        opts.lane_load_factor or DEFAULT_TOPOLOGY.lane_load_factor,
    )


async def scale_run(opts: Options) -> dict[str, Any]:
    # 256 groups of 300-word prompts: a replica's 1024 KV blocks hold a few of
    # them, the fleet's 64 x 1024 all of them.
    return await scale(
        opts.seed, opts.rate, opts.duration, 256, 300, opts.gpu_blocks, opts.replicas or 64,
        warmup=opts.warmup, lanes=_lanes(opts),
    )  # fmt: skip


async def kvindex_run(opts: Options) -> dict[str, Any]:
    # 16 replicas (--replicas), 4 groups of 300-word prompts a replica, as scale's
    # 64 x 256: hash lanes against the KV index, both through n -> n+1 -> n -> n-1
    # while the load runs.
    replicas = opts.replicas or 16
    return await scale(
        opts.seed, opts.rate, opts.duration, 4 * replicas, 300, opts.gpu_blocks,
        replicas=replicas, modes=("affinity", "kv_index"), name="kvindex", lanes=_lanes(opts),
    )  # fmt: skip


async def rollout_run(opts: Options) -> dict[str, Any]:
    return await rollout(opts.seed, opts.rate, opts.duration)


RUNNERS = {
    "affinity": affinity,
    "saturation": saturation,
    "failover": failover,
    "hedging": hedging,
    "soak": soak_run,
    "fairness": fairness_run,
    "scale": scale_run,
    "rollout": rollout_run,
    "kvindex": kvindex_run,
}


async def run_all(opts: Options) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in opts.scenarios:
        print(f"== {name}", flush=True)
        results[name] = await RUNNERS[name](opts)
        (opts.out / f"{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
        print(render(results[name]), flush=True)
    return results


def render(result: dict[str, Any]) -> str:
    """One markdown table per scenario: latency beside the admission rate."""
    head = (
        "| run | offered | admitted | admission rate | completed | goodput/s | rejected | "
        "failed | lost | TTFT p50 | TTFT p90 | TTFT p99 | prefix hit rate |"
    )
    lines = [f"### {result['scenario']}", "", f"setup: `{json.dumps(result['setup'])}`", ""]
    lines += [head, "|" + "---|" * 13]
    for r in result["rows"]:
        t = r["ttft_ms"]
        hit = "" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.1%}"
        lines.append(
            f"| {r['name']} | {r['offered']} | {r['admitted']} | {r['admission_rate']:.1%} | "
            f"{r['completed']} | {r['goodput_rps']} | {r['rejected']} | {r['failed']} | "
            f"{r['lost']} | {t['p50']} | {t['p90']} | {t['p99']} | {hit} |"
        )
    for r in result["rows"]:
        if r["extra"]:
            lines.append(f"\n{r['name']}: `{json.dumps(r['extra'])}`")
        if r["errors"]:
            lines.append(f"\n{r['name']} errors: `{json.dumps(r['errors'])}`")
    if "ledger" in result:
        lines.append(f"\nledger reconciliation: `{json.dumps(result['ledger'])}`")
    shown = (
        "balance",
        "hit_share_of_oracle",
        "changes",
        "changes_by_mode",
        "kv_routes",
        "capture",
        "rollout",
        "rollout_slow",
    )
    for key in shown:
        if key == "changes" and "changes_by_mode" in result:
            continue  # the same, under each arm's name
        if key in result:
            lines.append(f"\n{key}: `{json.dumps(result[key])}`")
    if "rss" in result:
        lines.append(f"\nRSS, first vs last window (MB): `{json.dumps(result['rss'])}`")
    return "\n".join(lines)

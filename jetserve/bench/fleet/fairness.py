"""`jetserve bench fleet --scenario fairness`: what one tenant's flood does to
another tenant's latency in the same class (issue 15's measure).

Two setups: one gateway and one replica (worker + h100-8b engine, 16 sequences
at a time), then two gateways and four replicas of 4 sequences each (requests
alternate between the gateways). For each, capacity first (the completion rate under overload),
then two runs of the same length:

- tenant B alone at a tenth of capacity;
- tenant B at the same rate while tenant A offers five times capacity (ten
  times its fair half). A starts :data:`FLOOD_LEAD_S` earlier: B is measured
  while A floods, not while the gateways first find the queue (the requests A
  sent before a look found it are queued in the class's own subject, where
  B's first requests wait behind them).

B's TTFT percentiles side by side, with A's outcome; the goal is B's p99 within
1.5x of B alone. Both tenants send the same class (interactive) and the same
request shape; the deadline is the same for both.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

import msgspec

from jetserve.bench.fleet.client import Driver, MakeRequest, Shot, chat, summarize
from jetserve.fleet import Fleet, FleetSpec

DEADLINE_S = 10.0
LEDGER_WAIT_S = 60.0  # for the flood's last records (the outbox scan runs every 5 s)
FLOOD_LEAD_S = 4.0
# (gateways, replicas, output tokens): the fleet's requests are longer, so that
# five times its capacity stays within what one 2-core machine can offer and
# drive (at 48 tokens the flood alone would be ~90 req/s of streams).
# (gateways, replicas, output tokens, vLLM's max_num_seqs per replica): both
# setups run 16 sequences in all, so the token rate stays what one 2-core
# machine can stream and drive (at 4x16 sequences the driver and the gateways,
# not the fleet, were the bottleneck: B's latency measured the machine).
SETUPS = ((1, 1, 192, 16), (2, 4, 192, 4))
# With 16 slots the excess leaves one spare for tenants in turn by default
# (admission.py); with 4 the replica is told to keep one.
SPARE = 1


def _make(key: str, tokens: int) -> MakeRequest:
    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        # Exactly ``tokens`` out (the simulator's text otherwise ends after
        # 16..64): the capacity and the flood are what the setup says.
        body = {
            **chat(None, f"Request {i}: summarise the ticket queue.", tokens),
            "ignore_eos": True,
        }
        return (
            "interactive",
            body,
            {
                "Authorization": f"Bearer {key}",
                "X-Jetserve-Timeout": str(DEADLINE_S),
            },
        )

    return make


def _start(gateways: int, replicas: int, seqs: int) -> tuple[Fleet, str]:
    fleet = Fleet(
        FleetSpec(
            workers=replicas,
            gateways=gateways,
            engine_per_worker=True,
            profile="h100-8b",
            sim_args=["--max-num-seqs", str(seqs)],
            worker_args=["--max-inflight", str(seqs), "--in-turn-spare", str(SPARE)],
        )
    ).start()
    with fleet.admin() as admin:
        admin.create_tenant("flood")
        key = str(admin.create_key("flood", "bench")["api_key"])
        admin.set_limits("tenant", "flood", rpm=1_000_000)
    return fleet, key


async def _drive(
    fleet: Fleet, seed: int, rate: float, duration: float, key: str, tokens: int
) -> list[Shot]:
    driver = Driver(fleet, seed, DEADLINE_S + 10)
    try:
        return await driver.run(rate, duration, _make(key, tokens))
    finally:
        await driver.aclose()


async def _setup(
    seed: int, duration: float, gateways: int, replicas: int, tokens: int, seqs: int
) -> dict[str, Any]:
    fleet, flood_key = await asyncio.to_thread(_start, gateways, replicas, seqs)
    try:
        await asyncio.sleep(1.5)  # lane priorities settle
        probe = await _drive(fleet, seed, 10.0 * replicas, 8.0, fleet.api_key or "", tokens)
        ends = sorted(s.sent + (s.e2e or 0) for s in probe if s.outcome == "ok")
        capacity = len(ends) / max(ends[-1] - ends[0], 1e-3) if len(ends) > 1 else 1.0
        b_rate, a_rate = capacity / 10, capacity * 5
        await asyncio.sleep(DEADLINE_S)  # the probe's queue drains or expires
        alone = await _drive(fleet, seed + 1, b_rate, duration, fleet.api_key or "", tokens)
        await asyncio.sleep(2.0)
        flood = asyncio.create_task(
            _drive(fleet, seed + 2, a_rate, duration + FLOOD_LEAD_S, flood_key, tokens)
        )
        await asyncio.sleep(FLOOD_LEAD_S)
        b_shots = await _drive(fleet, seed + 1, b_rate, duration, fleet.api_key or "", tokens)
        a_shots = await flood
        books = await asyncio.to_thread(_books, fleet, "flood", a_shots)
    finally:
        await asyncio.to_thread(fleet.stop)
    where = f"{gateways} gateway{'s' if gateways > 1 else ''}, {replicas} replica"
    where += "s" if replicas > 1 else ""
    rows = [
        summarize(f"tenant B alone ({where})", alone, duration),
        summarize(f"tenant B, tenant A flooding ({where})", b_shots, duration),
        summarize(f"  tenant A (the flood, {where})", a_shots, duration + FLOOD_LEAD_S),
    ]
    setup = {
        "gateways": gateways,
        "replicas": replicas,
        "output_tokens": tokens,
        "max_num_seqs": seqs,
        "in_turn_spare": SPARE,
        "capacity_rps": round(capacity, 2),
        "tenant_b_rps": round(b_rate, 2),
        "tenant_a_rps": round(a_rate, 2),
        "flood_ledger": books,
    }
    return {"setup": setup, "rows": [asdict(r) for r in rows]}


def _books(fleet: Fleet, tenant: str, shots: list[Shot]) -> dict[str, Any]:
    """The flood's accepted requests against its ledger: each must have one
    record, whatever the driver saw (a starved driver may see no end of a
    stream the gateway ended). Waits (bounded) for records still in the outbox."""
    accepted = {s.request_id for s in shots if s.request_id}
    unseen = {s.request_id for s in shots if s.request_id and s.outcome == "lost"}
    deadline = time.monotonic() + LEDGER_WAIT_S
    while True:
        with fleet.admin() as admin:
            rows = [msgspec.json.decode(x) for x in admin.ledger(tenant).splitlines() if x]
        ids = Counter(str(r["request_id"]) for r in rows)
        if accepted <= set(ids) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    ends = Counter(str(r["outcome"]) for r in rows if r["request_id"] in unseen)
    return {
        "accepted": len(accepted),
        "recorded": len(accepted & set(ids)),
        "recorded_twice": sum(1 for rid in accepted if ids[rid] > 1),
        "driver_saw_no_end": len(unseen),
        "their_recorded_outcomes": dict(ends),
    }


async def fairness(seed: int, duration: float) -> dict[str, Any]:
    only = os.environ.get("JETSERVE_FAIRNESS_SETUP")  # e.g. "2x4": one setup (a rerun)
    setups = [s for s in SETUPS if not only or only == f"{s[0]}x{s[1]}"]
    runs = [await _setup(seed, duration, *s) for s in setups]
    return {
        "scenario": "fairness",
        "setup": {
            "deadline_s": DEADLINE_S,
            "duration_s": duration,
            "flood_lead_s": FLOOD_LEAD_S,
            "runs": [run["setup"] for run in runs],
        },
        "rows": [row for run in runs for row in run["rows"]],
    }

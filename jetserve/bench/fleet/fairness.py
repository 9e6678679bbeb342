"""`jetserve bench fleet --scenario fairness`: what one tenant's flood does to
another tenant's latency in the same class (issue 15's measure).

One replica (worker + h100-8b engine, 4 sequences at a time). Capacity first
(the completion rate under overload), then two runs of the same length:

- tenant B alone at a tenth of capacity;
- tenant B at the same rate while tenant A offers five times capacity (ten
  times its fair half).

B's TTFT percentiles side by side, with A's outcome; the goal is B's p99 within
1.5x of B alone. Both tenants send the same class (interactive) and the same
request shape; the deadline is the same for both.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict
from typing import Any

from jetserve.bench.fleet.client import Driver, MakeRequest, Shot, chat, summarize
from jetserve.fleet import Fleet, FleetSpec

DEADLINE_S = 10.0
SIM = ["--max-num-seqs", "4"]
WORKER = ["--max-inflight", "4"]


def _make(key: str) -> MakeRequest:
    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        body = chat(None, f"Request {i}: summarise the ticket queue.", 48)
        return (
            "interactive",
            body,
            {
                "Authorization": f"Bearer {key}",
                "X-Jetserve-Timeout": str(DEADLINE_S),
            },
        )

    return make


def _start() -> tuple[Fleet, str]:
    fleet = Fleet(
        FleetSpec(
            workers=1, engine_per_worker=True, profile="h100-8b", sim_args=SIM, worker_args=WORKER
        )
    ).start()
    with fleet.admin() as admin:
        admin.create_tenant("flood")
        key = str(admin.create_key("flood", "bench")["api_key"])
        admin.set_limits("tenant", "flood", rpm=1_000_000)
    return fleet, key


async def _drive(fleet: Fleet, seed: int, rate: float, duration: float, key: str) -> list[Shot]:
    driver = Driver(fleet, seed, DEADLINE_S + 10)
    try:
        return await driver.run(rate, duration, _make(key))
    finally:
        await driver.aclose()


async def fairness(seed: int, duration: float) -> dict[str, Any]:
    fleet, flood_key = await asyncio.to_thread(_start)
    try:
        await asyncio.sleep(1.5)  # lane priorities settle
        probe = await _drive(fleet, seed, 40.0, 8.0, fleet.api_key or "")
        ends = sorted(s.sent + (s.e2e or 0) for s in probe if s.outcome == "ok")
        capacity = len(ends) / max(ends[-1] - ends[0], 1e-3) if len(ends) > 1 else 1.0
        b_rate, a_rate = capacity / 10, capacity * 5
        await asyncio.sleep(DEADLINE_S)  # the probe's queue drains or expires
        alone = await _drive(fleet, seed + 1, b_rate, duration, fleet.api_key or "")
        await asyncio.sleep(2.0)
        b_shots, a_shots = await asyncio.gather(
            _drive(fleet, seed + 1, b_rate, duration, fleet.api_key or ""),
            _drive(fleet, seed + 2, a_rate, duration, flood_key),
        )
    finally:
        await asyncio.to_thread(fleet.stop)
    rows = [
        summarize("tenant B alone", alone, duration),
        summarize("tenant B, tenant A flooding", b_shots, duration),
        summarize("  tenant A (the flood)", a_shots, duration),
    ]
    return {
        "scenario": "fairness",
        "setup": {
            "replicas": 1,
            "max_num_seqs": 4,
            "deadline_s": DEADLINE_S,
            "capacity_rps": round(capacity, 2),
            "tenant_b_rps": round(b_rate, 2),
            "tenant_a_rps": round(a_rate, 2),
            "duration_s": duration,
        },
        "rows": [asdict(r) for r in rows],
    }

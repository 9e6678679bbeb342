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
1.5x of B alone. The flood is driven from a process of its own: in the same
event loop as B's client, the flood's thousands of streams delayed B's reading
of its own first token, and B's tail measured the bench's client. Both tenants
send the same class (interactive) and the same request shape; the deadline is
the same for both.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from typing import Any

import msgspec

from jetserve.bench.fleet.client import (
    Driver,
    Gateways,
    GatewayUrls,
    MakeRequest,
    Shot,
    chat,
    pct_ms,
    summarize,
)
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
    fleet: Gateways, seed: int, rate: float, duration: float, key: str, tokens: int
) -> list[Shot]:
    driver = Driver(fleet, seed, DEADLINE_S + 10)
    try:
        return await driver.run(rate, duration, _make(key, tokens))
    finally:
        await driver.aclose()


def _drive_here(
    urls: GatewayUrls, seed: int, rate: float, duration: float, key: str, tokens: int
) -> list[Shot]:
    """:func:`_drive` in the process it is called in (the flood's own)."""
    return asyncio.run(_drive(urls, seed, rate, duration, key, tokens))


async def _drive_apart(
    fleet: Fleet, seed: int, rate: float, duration: float, key: str, tokens: int
) -> list[Shot]:
    """:func:`_drive` from a process of its own, so that its load does not
    delay the other tenant's client."""
    urls = GatewayUrls(list(fleet.base_urls), fleet.api_key)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return await asyncio.get_running_loop().run_in_executor(
            pool, _drive_here, urls, seed, rate, duration, key, tokens
        )


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
            _drive_apart(fleet, seed + 2, a_rate, duration + FLOOD_LEAD_S, flood_key, tokens)
        )
        await asyncio.sleep(FLOOD_LEAD_S)
        b_shots = await _drive(fleet, seed + 1, b_rate, duration, fleet.api_key or "", tokens)
        a_shots = await flood
        books = await asyncio.to_thread(_books, fleet, "flood", a_shots)
        b_ledger = await asyncio.to_thread(_first_tokens, fleet, fleet.spec.tenant)
    finally:
        await asyncio.to_thread(fleet.stop)
    where = f"{gateways} gateway{'s' if gateways > 1 else ''}, {replicas} replica"
    where += "s" if replicas > 1 else ""
    rows = [
        summarize(
            f"tenant B alone ({where})",
            alone,
            duration,
            slowest_ttft_ms=_slowest(alone),
            gateway_first_token_ms=_gateway_pcts(alone, b_ledger),
        ),
        summarize(
            f"tenant B, tenant A flooding ({where})",
            b_shots,
            duration,
            slowest_ttft_ms=_slowest(b_shots),
            their_gateway_first_token_ms=_at_gateway(b_shots, b_ledger),
            gateway_first_token_ms=_gateway_pcts(b_shots, b_ledger),
        ),
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


def _slowest(shots: list[Shot], n: int = 5) -> list[float]:
    """The slowest first tokens (ms): with a few dozen requests, p99 is the
    slowest one, and these say whether it is one request or a tail."""
    ttfts = sorted((s.ttft for s in shots if s.ttft is not None), reverse=True)
    return [round(t * 1000, 1) for t in ttfts[:n]]


def _first_tokens(fleet: Fleet, tenant: str) -> dict[str, float | None]:
    """Request id -> the ledger's first-token delay (the gateway's own clock,
    from acceptance), to tell a delay in the fleet from one in the client."""
    with fleet.admin() as admin:
        rows = [msgspec.json.decode(x) for x in admin.ledger(tenant).splitlines() if x]
    return {str(r["request_id"]): r.get("first_token_ms") for r in rows}


def _at_gateway(shots: list[Shot], ledger: dict[str, float | None], n: int = 5) -> list[Any]:
    """The ledger's first-token delays of the ``n`` slowest as the client saw them."""
    slow = sorted((s for s in shots if s.ttft is not None), key=lambda s: -(s.ttft or 0))[:n]
    return [_ms(ledger.get(s.request_id or "")) for s in slow]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _gateway_pcts(shots: list[Shot], ledger: dict[str, float | None]) -> dict[str, Any]:
    """B's first-token percentiles on the gateway's clock (acceptance to first
    token): the fleet's share of the client's TTFT, without the HTTP hop and
    the client's own process, which share the machine's two cores."""
    values = [ledger.get(s.request_id or "") for s in shots if s.outcome == "ok"]
    ms = [v / 1000 for v in values if v is not None]
    return {f"p{q}": pct_ms(ms, q) for q in (50, 90, 99)}


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

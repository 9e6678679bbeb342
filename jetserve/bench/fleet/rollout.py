"""``rollout``: a bad canary under open-loop load, and the guard that rolls it
back (docs/rollout.md).

Two replicas of the stable deployment, one of the canary deployment. The route
``sim-8b`` starts plain; load starts; a third of the way in, a revision with a
canary on the bad deployment (``share`` of all interactive traffic) is
applied. Two runs, a fleet each:

- failing: the canary's engine answers every request with a 503 (the error
  guard). Harmed: the canary-arm requests that failed.
- slow: every first token of the canary's engine comes :data:`SLOW_MS` late
  (the first-token guard); nothing fails. Harmed: the canary-arm requests
  served while it lasted, each that much slower.

Measured: the seconds from that apply to the guard's rollback, the requests
the canary harmed, and that every accepted request has its one ledger record.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import httpx
import msgspec

from jetserve.bench.fleet.client import Driver, chat, ledger_check, summarize
from jetserve.fleet import Fleet, FleetSpec

ROUTE = "sim-8b"
SHARE = 0.2
GUARD = {"min_samples": 20, "window_s": 60.0, "max_error_ratio": 2.0, "max_ttft_p95_ratio": 1.5}
GUARD_EVERY_S = 2.0  # the gateway's default
SLOW_MS = 300
CANARIES = {
    "failing": ("503=1.0", "every answer a 503 (simulator --fault-rate 503=1.0)"),
    "slow": (
        f"stall:{SLOW_MS}=1.0",
        f"every first token {SLOW_MS} ms late (simulator --fault-rate stall:{SLOW_MS}=1.0)",
    ),
}


def _contract(canary: bool) -> dict[str, Any]:
    cands = [
        {"name": d, "adapter": "openai", "engine": "jetserve-sim", "model": ROUTE}
        for d in ("dep-stable", "dep-canary")
    ]
    body: dict[str, Any] = {"name": ROUTE, "candidates": cands}
    if canary:
        body["rollout"] = {"canary": {"candidate": "dep-canary", "share": SHARE}, "guard": GUARD}
    return body


def _start(profile: str, fault: str) -> Fleet:
    fleet = Fleet(FleetSpec(workers=0, engine_per_worker=True, profile=profile)).start()
    fleet.start_worker("--deployment-name", "dep-stable")
    fleet.start_worker("--deployment-name", "dep-stable")
    fleet.start_worker("--deployment-name", "dep-canary", sim_args=["--fault-rate", fault])
    fleet.wait_workers(3)
    return fleet


async def rollout(seed: int, rate: float, duration: float) -> dict[str, Any]:
    profile = "h100-8b"
    failing = await _run(profile, "failing", seed, rate, duration)
    slow = await _run(profile, "slow", seed, rate, duration)
    return {
        "scenario": "rollout",
        "setup": {
            "profile": profile,
            "stable_replicas": 2,
            "canary": "1 replica: " + CANARIES["failing"][1],
            "slow_canary": "1 replica: " + CANARIES["slow"][1],
            "share": SHARE,
            "guard": GUARD,
            "guard_every_s": GUARD_EVERY_S,
            "rate_rps": rate,
            "duration_s": duration,
        },
        "rollout": failing["found"],
        "rollout_slow": slow["found"],
        "ledger": failing["ledger"],
        "ledger_slow": slow["ledger"],
        "rows": [failing["row"], slow["row"]],
    }


async def _run(profile: str, kind: str, seed: int, rate: float, duration: float) -> dict[str, Any]:
    fleet = await asyncio.to_thread(_start, profile, CANARIES[kind][0])
    admin = httpx.AsyncClient(
        base_url=fleet.admin_url,
        headers={"Authorization": f"Bearer {fleet.admin_token}"},
        timeout=30,
    )
    found: dict[str, Any] = {}

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        return "interactive", chat(None, f"Request {i}: a short answer please.", 32), {}

    async def bad_canary() -> None:
        await asyncio.sleep(duration / 3)
        r = await admin.put(f"/admin/routes/{ROUTE}", json=_contract(canary=True))
        r.raise_for_status()
        applied = time.monotonic()
        found["canary_revision"] = r.json()["revision"]
        found["canary_applied_at_s"] = round(duration / 3, 1)
        while time.monotonic() - applied < duration:
            shown = (await admin.get(f"/admin/routes/{ROUTE}")).json()
            if shown["revision"] > found["canary_revision"]:
                found["rolled_back_after_s"] = round(time.monotonic() - applied, 2)
                found["rollback"] = shown.get("rollback")
                return
            await asyncio.sleep(0.1)

    driver = Driver(fleet, seed, 60.0)
    try:
        (await admin.put(f"/admin/routes/{ROUTE}", json=_contract(canary=False))).raise_for_status()
        await asyncio.sleep(1.5)  # lane priorities settle after the last worker joined
        shots = await driver.run(rate, duration, make, bad_canary)
        ledger = await ledger_check(fleet, shots)
        with fleet.admin() as a:
            text = await asyncio.to_thread(a.ledger, fleet.spec.tenant)
    finally:
        await driver.aclose()
        await admin.aclose()
        await asyncio.to_thread(fleet.stop)
    records = [msgspec.json.decode(x) for x in text.splitlines() if x]
    on_canary = [r for r in records if r.get("rollout_arm") == "canary"]
    stable = [r for r in records if r.get("rollout_arm") == "stable"]
    failed = [r for r in on_canary if r["status"] >= 500]
    found.update(
        canary_arm_requests=len(on_canary),
        canary_arm_failed=len(failed),
        canary_served_ok=sum(1 for r in on_canary if r["status"] == 200),
        stable_arm_requests=len(stable),
        stable_arm_failed=sum(1 for r in stable if r["status"] >= 500),
        served_by_canary_deployment=sum(1 for r in records if r["deployment"] == "dep-canary"),
        # Harmed: failed (failing), or served late (slow: every one of its answers).
        harmed=len(failed) if kind == "failing" else len(on_canary),
        canary_ttft_p50_ms=_p50(r["first_token_ms"] for r in on_canary),
        stable_ttft_p50_ms=_p50(r["first_token_ms"] for r in stable),
    )
    row = summarize(f"{kind} canary at {SHARE:.0%}", shots, duration)
    return {"found": found, "ledger": ledger, "row": asdict(row)}


def _p50(values: Iterable[float | None]) -> float | None:
    got = sorted(v for v in values if v is not None)
    return round(got[(len(got) - 1) // 2], 1) if got else None

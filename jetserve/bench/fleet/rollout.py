"""``rollout``: a bad canary under open-loop load, and the guard that rolls it
back (docs/rollout.md).

Two replicas of the stable deployment, one of the canary deployment, whose
engine answers every request with a 503. The route ``sim-8b`` starts plain;
load starts; a third of the way in, a revision with a canary on the bad
deployment (``share`` of all interactive traffic) is applied. Measured: the
seconds from that apply to the guard's rollback, the requests the canary harmed
(accepted on the canary arm and failed), and that every accepted request has
its one ledger record.
"""

from __future__ import annotations

import asyncio
import random
import time
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


def _contract(canary: bool) -> dict[str, Any]:
    cands = [
        {"name": d, "adapter": "openai", "engine": "jetserve-sim", "model": ROUTE}
        for d in ("dep-stable", "dep-canary")
    ]
    body: dict[str, Any] = {"name": ROUTE, "candidates": cands}
    if canary:
        body["rollout"] = {"canary": {"candidate": "dep-canary", "share": SHARE}, "guard": GUARD}
    return body


def _start(profile: str) -> Fleet:
    fleet = Fleet(FleetSpec(workers=0, engine_per_worker=True, profile=profile)).start()
    fleet.start_worker("--deployment-name", "dep-stable")
    fleet.start_worker("--deployment-name", "dep-stable")
    fleet.start_worker("--deployment-name", "dep-canary", sim_args=["--fault-rate", "503=1.0"])
    fleet.wait_workers(3)
    return fleet


async def rollout(seed: int, rate: float, duration: float) -> dict[str, Any]:
    profile = "h100-8b"
    fleet = await asyncio.to_thread(_start, profile)
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
    harmed = [r for r in on_canary if r["status"] >= 500]
    stable = [r for r in records if r.get("rollout_arm") == "stable"]
    found.update(
        canary_arm_requests=len(on_canary),
        canary_arm_failed=len(harmed),
        canary_served_ok=sum(1 for r in on_canary if r["status"] == 200),
        stable_arm_requests=len(stable),
        stable_arm_failed=sum(1 for r in stable if r["status"] >= 500),
        served_by_canary_deployment=sum(1 for r in records if r["deployment"] == "dep-canary"),
    )
    row = summarize(f"bad canary at {SHARE:.0%}", shots, duration)
    return {
        "scenario": "rollout",
        "setup": {
            "profile": profile,
            "stable_replicas": 2,
            "canary": "1 replica, every answer a 503 (simulator --fault-rate 503=1.0)",
            "share": SHARE,
            "guard": GUARD,
            "guard_every_s": GUARD_EVERY_S,
            "rate_rps": rate,
            "duration_s": duration,
        },
        "rollout": found,
        "ledger": ledger,
        "rows": [asdict(row)],
    }

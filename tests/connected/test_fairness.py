"""Tenants in turn within a class, through real processes (gateway/inference/
fair_gate.py): while one tenant keeps the class saturated, another tenant's
request goes ahead of the flood's queue instead of behind it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]

FLOOD_CLIENTS = 24


def body(text: str) -> dict[str, object]:
    return {"model": "sim-8b", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}


async def test_a_second_tenant_is_served_ahead_of_a_flood(
    make_fleet: Callable[..., Fleet],
) -> None:
    # One engine serving one request at a time, ~0.1 s each: a closed loop of
    # 24 clients keeps a queue ~24 deep.
    fleet = make_fleet(
        workers=1, sim_args=["--max-num-seqs", "1"], worker_args=["--max-inflight", "1"]
    )
    with fleet.admin() as admin:
        admin.create_tenant("flood")
        flood_key = admin.create_key("flood", "k")["api_key"]
        admin.set_limits("tenant", "flood", rpm=1_000_000)
    url = f"{fleet.base_url}/v1/chat/completions"
    slow = {"X-Sim-Fault": "slow:12", "X-Jetserve-Timeout": "60"}
    flood_done: list[float] = []
    stop = asyncio.Event()
    warm = asyncio.Event()  # the flood has been going a while

    async def flood(c: httpx.AsyncClient, n: int) -> None:
        headers = {"Authorization": f"Bearer {flood_key}", **slow}
        i = 0
        while not stop.is_set():
            r = await c.post(url, json=body(f"flood {n}.{i}"), headers=headers)
            assert r.status_code == 200, r.text
            flood_done.append(time.monotonic())
            if len(flood_done) >= 3 * FLOOD_CLIENTS:
                warm.set()
            i += 1

    async with httpx.AsyncClient(timeout=90) as c:
        floods = [asyncio.create_task(flood(c, n)) for n in range(FLOOD_CLIENTS)]
        # Past the first burst (which the gate lets through while the queue looked
        # empty): the flood is now held at the gateway, in its tenant's queue.
        await asyncio.wait_for(warm.wait(), 60)
        sent = time.monotonic()
        headers = {"Authorization": f"Bearer {fleet.api_key}", **slow}
        r = await c.post(url, json=body("the other tenant"), headers=headers)
        done = time.monotonic()
        stop.set()
        await asyncio.gather(*floods)
    assert r.status_code == 200, r.text
    # Flood requests that finished while the other tenant's one waited: the queue
    # ahead of it. First come, first served, that is the whole flood (~24); in
    # turn, only what was already in JetStream's queue and the engine.
    ahead = sum(1 for t in flood_done if sent < t < done)
    assert ahead <= FLOOD_CLIENTS // 2, ahead

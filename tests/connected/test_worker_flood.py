"""Deliveries are spent on failures, not on traffic: a burst far above the
fleet's capacity, on prefix lanes and the plain class subject alike, all
completes and none of it reaches the dead-letter queue; a request whose engine
really fails every attempt does, with its reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from nats.js.api import RawStreamMsg

from jetserve.fleet import Fleet
from streams.definitions import DEFAULT_TOPOLOGY
from streams.headers import Header
from tests.connected.test_affinity import settled
from tests.scrape import metric_sum

pytestmark = [pytest.mark.connected, pytest.mark.timeout(300)]

BURST = 240  # 30 times what the fleet runs at once
GROUPS = 24  # shared system prompts: the gateway spreads them over the lanes


def system_prompt(group: int) -> str:
    rules = "".join(f"Rule {i}: answer group {group} politely and briefly. " for i in range(12))
    return f"You are assistant number {group}. {rules}"


def chat(i: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Question {i}?"}]
    if i % 4:  # three in four on a lane, the rest on the class subject
        messages.insert(0, {"role": "system", "content": system_prompt(i % GROUPS)})
    return {"model": "sim-8b", "max_tokens": 8, "stream": True, "messages": messages}


async def stream(c: httpx.AsyncClient, fleet: Fleet, i: int) -> tuple[int, str]:
    """(status, how it ended) of one streaming request."""
    headers = {
        "Authorization": f"Bearer {fleet.api_key}",
        "X-Sim-Fault": "slow:15",
        "X-Jetserve-Timeout": "240",
    }
    url = f"{fleet.base_url}/v1/chat/completions"
    async with c.stream("POST", url, json=chat(i), headers=headers) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return 200, "done"
            if line.startswith("data: ") and '"error"' in line:
                return 200, json.loads(line[6:])["error"]["code"]
    return 200, "ended without [DONE]"


async def dead_letters(fleet: Fleet) -> list[RawStreamMsg]:
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        info = await js.stream_info(DEFAULT_TOPOLOGY.dlq_stream)
        if not info.state.messages:
            return []
        first, last = info.state.first_seq, info.state.last_seq
        return [await js.get_msg(DEFAULT_TOPOLOGY.dlq_stream, s) for s in range(first, last + 1)]
    finally:
        await nc.close()


async def test_a_burst_far_above_capacity_completes_without_dead_letters(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Two workers of 4 slots: 8 requests at once; 240 arrive together.
    fleet = make_fleet(workers=2, worker_args=["--max-inflight", "4"])
    # The lanes' pulls made before the second worker joined are withdrawn.
    await settled(fleet)
    limits = httpx.Limits(max_connections=BURST + 10)
    async with httpx.AsyncClient(timeout=280, limits=limits) as c:
        ends = await asyncio.gather(*(stream(c, fleet, i) for i in range(BURST)))
        gw = (await c.get(fleet.gateway_metrics_urls[0])).text
        workers = [
            (await c.get(f"http://127.0.0.1:{port}/metrics")).text
            for port in fleet.worker_metrics_ports
        ]
    events = {
        e: sum(metric_sum(w, "jetserve_worker_lane_events_total", event=e) for w in workers)
        for e in ("pull", "held", "handed_back")
    }
    failed = [(i, end) for i, end in enumerate(ends) if end != (200, "done")]
    print(f"\nburst of {BURST}: {len(failed)} failed; lane events {events}")
    assert not failed, failed[:10]
    assert await dead_letters(fleet) == []
    assert metric_sum(gw, "jetserve_gateway_rejected_total", reason="max_deliveries_exceeded") == 0
    served = sum(metric_sum(w, "jetserve_worker_requests_total", outcome="ok") for w in workers)
    assert served == BURST  # each ran once: no attempt was lost to a redelivery


async def test_an_engine_that_fails_every_attempt_dead_letters_the_request(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=2)
    attempts = DEFAULT_TOPOLOGY.limits.max_attempts
    body = {"model": "sim-8b", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "503"},
        )
        stats = (await c.get(f"{fleet.sim_url}/sim/stats")).json()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert stats["faults"].get("503") == attempts  # every attempt reached the engine
    dead = await dead_letters(fleet)
    assert len(dead) == 1
    headers = dead[0].headers or {}
    assert headers[Header.DLQ_REASON.value].startswith(f"{attempts} failed attempts; last ")
    assert json.loads(dead[0].data or b"{}")["id"] == r.headers["x-request-id"]

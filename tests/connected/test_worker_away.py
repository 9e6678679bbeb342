"""A worker cut off from NATS while it serves: what was said meanwhile reaches it
when it is back. Its connection goes through a proxy the test cuts; the
gateway, nats-server and the simulator stay up and connected."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.marks import until_marked
from tests.scrape import fleet_sum
from tests.tcp_cut import CutProxy
from tests.waits import until

pytestmark = pytest.mark.connected

CHAT = {"model": "sim-8b", "messages": [{"role": "user", "content": "a long answer, please"}]}
TOKENS = 400
SLOW_MS = 50  # per token: the whole answer takes 20 s


async def test_a_cancel_sent_while_the_worker_was_away_stops_the_stream_it_runs(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0)
    async with CutProxy(fleet.nats_nodes[0].port) as proxy:
        # Waited for off the loop: the proxy runs on it.
        fleet.start_worker("--nats", proxy.url, wait=False)
        await asyncio.to_thread(fleet.wait_workers, 1)
        metrics = [f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics"]
        headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": f"slow:{SLOW_MS}"}
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream(
                "POST",
                f"{fleet.base_url}/v1/chat/completions",
                json={**CHAT, "stream": True, "max_tokens": TOKENS, "ignore_eos": True},
                headers=headers,
            ) as r,
        ):
            assert r.status_code == 200
            request_id = r.headers["X-Request-Id"]
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    break  # it runs: the first token came
            proxy.cut()  # the worker is away; the engine goes on generating
        # The client hung up: the gateway cancels, live (the worker, away, does
        # not hear it) and in the durable mark.
        await until_marked(fleet, request_id, "the cancel's durable mark")
        before = proxy.accepted
        proxy.restore()
        await until(lambda: _true(proxy.accepted > before), "the worker back on NATS")

        async def ended() -> float:
            return await fleet_sum(metrics, "jetserve_worker_requests_total")

        # Before the fix the stream ran its 20 s to the end ("ok"): the marks
        # were read again only when the worker started its next request.
        await until(ended, "the stream ended at the worker", bound_s=TOKENS * SLOW_MS / 1000)
        cancelled = await fleet_sum(metrics, "jetserve_worker_requests_total", outcome="cancelled")
        assert cancelled == 1
        assert await fleet_sum(metrics, "jetserve_worker_requests_total", outcome="ok") == 0


async def _true(value: bool) -> bool:
    return value

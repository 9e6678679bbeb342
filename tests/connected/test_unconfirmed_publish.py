"""A publish whose acknowledgement never came: the gateway refuses the request
(503 ``bus_unavailable``), but the request may have been stored, so it must not
run, uncharged, once a worker pulls it. The gateway's link to NATS goes through
a proxy that holds what the server sends: the request is stored, its
acknowledgement waits past the publish's timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet
from tests.marks import until_marked
from tests.scrape import fleet_sum
from tests.tcp_cut import CutProxy
from tests.waits import until

pytestmark = pytest.mark.connected

CHAT = {"model": "sim-8b", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_refused_request_whose_publish_went_unconfirmed_never_runs(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0)
    async with (
        CutProxy(fleet.nats_nodes[0].port) as proxy,
        httpx.AsyncClient(timeout=60) as c,
    ):
        fleet.start_gateway("--nats", proxy.url, wait=False)
        await asyncio.to_thread(fleet.wait_gateway, 1)  # off the loop: the proxy runs on it
        started_before = (await c.get(f"{fleet.sim_url}/sim/stats")).json()["started"]
        proxy.stall()
        r = await c.post(
            f"{fleet.base_urls[1]}/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "bus_unavailable"
        proxy.flow()

        def refusals() -> list[str]:
            with fleet.admin() as admin:
                text = admin.ledger(fleet.spec.tenant)
            rows = [msgspec.json.decode(x) for x in text.splitlines() if x]
            return [r["request_id"] for r in rows if r["outcome"] == "bus_unavailable"]

        # Recorded through the outbox, once the gateway's link flows again.
        await until(lambda: asyncio.to_thread(refusals), "the refusal's ledger record")
        (request_id,) = refusals()
        await until_marked(fleet, request_id, "the refused request's cancel mark")
        # A worker now: it pulls the stored request, and ends it unrun.
        await asyncio.to_thread(fleet.start_worker)
        metrics = [f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics"]

        async def ended() -> float:
            return await fleet_sum(metrics, "jetserve_worker_requests_total")

        await until(ended, "the worker to end the stored request")
        assert await fleet_sum(metrics, "jetserve_worker_requests_total", outcome="cancelled") == 1
        stats = (await c.get(f"{fleet.sim_url}/sim/stats")).json()
        assert stats["started"] == started_before
    with fleet.admin() as admin:
        assert int(admin.get_limits("tenant", fleet.spec.tenant)["reserved_micros"]) == 0

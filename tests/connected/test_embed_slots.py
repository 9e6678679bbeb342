"""A worker in front of a pooling engine keeps its embedding slots busy.

Embeddings are a lower class: they take a slot while the reserve stays free and
interactive is not asking for one. Interactive's excess puller, polling an
empty subject, used to count as asking whenever a moment's scarcity made it
wait, and that held every embedding back for ``starve_after`` (issue 17: the
worker had nothing in flight half the time while clients waited)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.waits import until

pytestmark = pytest.mark.connected

N = 6


async def test_embeddings_fill_the_slots_a_pooling_engine_worker_has(
    make_fleet: Callable[..., Fleet],
) -> None:
    # vLLM's pooling runner reports one 128-token KV block: slots alone admit.
    # Four slots: interactive's puller polls with one and one is its reserve, so
    # embeddings may hold two. Each call stays 1 s at the engine; meanwhile
    # interactive's excess puller (polling every quarter second) finds one slot
    # free and waits. With --starve-after 60, counting that wait as interactive
    # demand kept the next embedding out for a minute.
    fleet = make_fleet(
        workers=1,
        profile="h100-8b",
        sim_args=["--num-gpu-blocks", "1", "--block-size", "128"],
        worker_args=["--max-inflight", "4", "--starve-after", "60", "--embed-batching", "off"],
    )
    auth = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "stall:1000"}

    async def one(c: httpx.AsyncClient, i: int) -> str:
        r = await c.post(
            f"{fleet.base_url}/v1/embeddings",
            json={"model": "sim-embed", "input": f"text number {i}"},
            headers=auth,
        )
        assert r.status_code == 200, r.text
        return r.headers["X-Request-Id"]

    async with httpx.AsyncClient(timeout=120) as c:
        calls = [asyncio.create_task(one(c, i)) for i in range(N)]

        async def served() -> bool:
            for t in calls:
                if t.done():
                    t.result()  # a failed request fails the test now
            return all(t.done() for t in calls)

        await until(served, "every embedding served", bound_s=40)
        ids = [t.result() for t in calls]
        records = [(await c.get(f"{fleet.sim_url}/sim/requests/{rid}")).json() for rid in ids]
    spans = [(r["arrived_at"], r["finished_at"]) for r in records]
    # The engine ran two at a time: as many as the worker may hold, never more.
    peak = max(sum(a <= t < f for a, f in spans) for t, _ in spans)
    assert peak == 2, spans

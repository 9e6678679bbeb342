"""A worker prefers interactive over batch, and batch still progresses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected


async def test_interactive_overtakes_queued_batch_without_starving_it(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1, worker_args=["--max-inflight", "2"])
    auth = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:25"}

    async def call(c: httpx.AsyncClient, cls: str, i: int) -> float:
        body = {
            "model": "sim-8b",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": f"{cls} job {i}"}],
        }
        start = time.monotonic()
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=body,
            headers={**auth, "X-Jetserve-Class": cls},
        )
        assert r.status_code == 200, r.text
        return time.monotonic() - start

    async with httpx.AsyncClient(timeout=60) as c:
        batch = [asyncio.create_task(call(c, "batch", i)) for i in range(6)]
        await asyncio.sleep(0.3)  # batch is queued behind a single batch slot
        interactive = await call(c, "interactive", 0)
        batch_times = await asyncio.gather(*batch)
    one_job = min(batch_times)  # ~20 tokens x 25 ms
    # Interactive did not wait for the batch backlog (6 jobs, one at a time) ...
    assert interactive < 2 * one_job
    # ... and every batch job still completed.
    assert len(batch_times) == 6
    assert max(batch_times) > 3 * one_job

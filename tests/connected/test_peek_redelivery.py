"""A lower class's request handed back (nak'd, as a draining worker hands back what
it has not started) while the only worker is busy with interactive work: the
worker's batch puller peeks at num_pending, which leaves out a message waiting to
be delivered again (streams/consumer.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from streams.auth import Role
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import RequestClass
from tests.connected.test_pools import worker_metric
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]


async def test_a_handed_back_request_is_served_by_a_busy_worker_with_free_slots(
    make_fleet: Callable[..., Fleet],
) -> None:
    """It waited for a new message of its class, or its deadline (an agent's model
    call that got one 503 on a busy fleet ended 504), with 7 of 8 slots free: here
    it was served only when the interactive stream ended, 30 s later."""
    fleet = make_fleet(workers=1, worker_args=["--max-inflight", "8"], gateway_args=["--no-shed"])
    auth = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "170"}
    url = f"{fleet.base_url}/v1/chat/completions"
    chat = {"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=170) as c:
        # The worker busy (not quiet) for minutes with one slow interactive stream.
        slow = {**auth, "X-Sim-Fault": "slow:500"}
        long = asyncio.create_task(c.post(url, json={**chat, "max_tokens": 1000}, headers=slow))

        async def peeking() -> bool:  # its lower classes' pullers peek, not pull
            return await worker_metric(c, fleet, 0, "jetserve_worker_pending_peeks_total") > 0

        await until(peeking, "the worker's lower-class pullers peeking")
        rogue = await connect(fleet.nats_url, "rogue", fleet.bus_auth(Role.WORKER))
        try:
            sub = await rogue.jetstream().pull_subscribe_bind(
                DEFAULT_TOPOLOGY.consumer_name(RequestClass.BATCH),
                DEFAULT_TOPOLOGY.stream_of(RequestClass.BATCH),
            )
            taking = asyncio.create_task(sub.fetch(1, timeout=60))

            async def waiting() -> bool:  # the rogue's pull is at the server
                return bool((await sub.consumer_info()).num_waiting)

            await until(waiting, "the rogue pull waiting")
            job = {**chat, "max_tokens": 4}
            as_batch = {**auth, "X-Jetserve-Class": "batch"}
            batch = asyncio.create_task(c.post(url, json=job, headers=as_batch))
            (msg,) = await taking
            await msg.nak()  # handed back, unstarted
            done, _ = await asyncio.wait({batch, long}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await rogue.close()
        assert batch in done, "the handed-back request waited for the interactive stream"
        assert batch.result().status_code == 200, batch.result().text
        long.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long

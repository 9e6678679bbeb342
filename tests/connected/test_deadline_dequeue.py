"""A request its gateway gave up on at its deadline leaves the work queue."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from streams.definitions import DEFAULT_TOPOLOGY
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(120)]

CHAT = {"model": "sim-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_request_past_its_deadline_is_removed_from_its_queue(
    make_fleet: Callable[..., Fleet],
) -> None:
    """No worker pulls the queue (a route's candidate not started, a pool scaled to
    zero): the client got its 504 at the deadline, but the message stayed queued
    for the stream's max_age (an hour), counted in the class's depth, which the
    fair gate, shedding and the scaler read: a few such requests held back every
    tenant of the class. The gateway now cancels what it gives up on."""
    fleet = make_fleet(workers=0)
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "2"}
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(f"{fleet.base_url}/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    nc = await fleet.connect()
    try:
        js = nc.jetstream()

        async def queued() -> int:
            infos = [await js.stream_info(name) for name in DEFAULT_TOPOLOGY.request_streams]
            return sum(info.state.messages for info in infos)

        async def emptied() -> bool:
            return await queued() == 0

        await until(emptied, "the given-up request removed from the work queue")
    finally:
        await nc.close()

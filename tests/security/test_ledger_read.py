"""A tenant's ledger read is streamed: the gateway holds a chunk of it, not all of
it (gateway/web.py ``ledger_lines``). A tenant makes records at will (every
refusal is one), so a whole-ledger read built in memory was a way to exhaust a
gateway (200,000 records: 470 MB)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from jetserve.fleet import Fleet
from streams.request_ledger import DEFAULT_LEDGER, encode_record
from tests.connected.test_ledger import record
from tests.security.memory import MIB, Growth
from tests.security.test_http_limits import gateway_pid
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]

RECORDS = 30_000  # ~2.3 KB each in memory when built whole: ~70 MB


async def fill(fleet: Fleet, first: int, n: int) -> None:
    """``n`` records of the fleet's tenant in its ledger."""
    tenant = fleet.spec.tenant
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        subject, stream = DEFAULT_LEDGER.subject(tenant), DEFAULT_LEDGER.stream
        for start in range(first, first + n, 1000):
            await asyncio.gather(
                *(
                    js.publish(subject, encode_record(record(tenant, i)), stream=stream)
                    for i in range(start, min(start + 1000, first + n))
                )
            )
    finally:
        await nc.close()


async def test_a_whole_ledger_read_streams_in_bounded_memory(fleet: Fleet) -> None:
    await fill(fleet, 0, RECORDS)
    growth = Growth(gateway_pid(fleet))
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    lines = 0
    async with (
        httpx.AsyncClient(timeout=120) as c,
        c.stream("GET", f"{fleet.base_url}/v1/ledger", headers=headers) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            lines += bool(line)
    assert lines >= RECORDS
    assert growth.bytes() < 24 * MIB, growth.bytes() / MIB


async def test_a_read_its_client_leaves_deletes_its_consumer_at_once(fleet: Fleet) -> None:
    """The body's cleanup runs shielded from Starlette's cancel scope (a client that
    leaves cancels the body), so the read's consumer goes at once, not at the
    server's inactivity bound (5 minutes, for slow readers)."""
    await fill(fleet, RECORDS, 2000)  # more than one chunk: the read goes on
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        stream = DEFAULT_LEDGER.stream

        async def consumers() -> int:
            return (await js.stream_info(stream)).state.consumer_count

        before = await consumers()
        headers = {"Authorization": f"Bearer {fleet.api_key}"}
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream("GET", f"{fleet.base_url}/v1/ledger", headers=headers) as r,
        ):
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                break  # the first line, then gone (the read has much more)
            assert await consumers() == before + 1  # the read's consumer, still reading

        async def deleted() -> bool:
            return await consumers() == before

        await until(deleted, "the left read's consumer deleted")
    finally:
        await nc.close()

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

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]

RECORDS = 30_000  # ~2.3 KB each in memory when built whole: ~70 MB


async def test_a_whole_ledger_read_streams_in_bounded_memory(fleet: Fleet) -> None:
    tenant = fleet.spec.tenant
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        subject, stream = DEFAULT_LEDGER.subject(tenant), DEFAULT_LEDGER.stream
        for start in range(0, RECORDS, 1000):
            await asyncio.gather(
                *(
                    js.publish(subject, encode_record(record(tenant, i)), stream=stream)
                    for i in range(start, start + 1000)
                )
            )
    finally:
        await nc.close()
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

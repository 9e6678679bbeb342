"""Fleet-wide leases (streams/leases.py) on a real nats-server, with the
gateway's own credential: one holder at a time, renewal, take-over once run
out, and release. The clock is injected: no test waits for a ttl to pass."""

from __future__ import annotations

import pytest

from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.leases import KvLease, ensure_leases

pytestmark = pytest.mark.connected


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def test_one_holder_renewal_takeover_and_release(nats_server: Service) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    a_nc = await connect(url, "lease-a", nats_server.bus_auth(Role.GATEWAY))
    b_nc = await connect(url, "lease-b", nats_server.bus_auth(Role.GATEWAY))
    try:
        a_clock, b_clock = Clock(), Clock()
        a = KvLease(await ensure_leases(a_nc.jetstream()), "job", "gw-a", 10.0, a_clock)
        b = KvLease(await ensure_leases(b_nc.jetstream()), "job", "gw-b", 10.0, b_clock)
        assert await a.hold()
        assert not await b.hold()
        a_clock.now += 5
        assert await a.hold()  # renewed: runs until 1015 now
        b_clock.now += 12  # past the first term, not the renewed one
        assert not await b.hold()
        b_clock.now += 10  # a stalled: its lease ran out
        assert await b.hold()
        assert b.held
        a_clock.now += 1
        assert not await a.hold()  # its renewal finds b's revision
        assert not a.held
        await b.release()
        assert await a.hold()  # free again
        # A restarted holder (same owner, no revision in memory) takes its own lease back.
        again = KvLease(a.kv, "job", "gw-a", 10.0, a_clock)
        assert await again.hold()
        b_clock.now = a_clock.now
        assert not await b.hold()
    finally:
        await a_nc.close()
        await b_nc.close()

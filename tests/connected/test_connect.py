"""The one connection helper (streams/connect.py) against a real nats-server:
a flush that is cancelled or times out must not end the connection's reading
(nats-py sets a result on its cancelled PONG future, which ends its read loop:
every later flush times out and nothing more is received)."""

from __future__ import annotations

import asyncio

import pytest

from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect

pytestmark = pytest.mark.connected


async def test_a_cancelled_flush_leaves_the_connection_reading(nats_server: Service) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    nc = await connect(url, "test-connect", nats_server.bus_auth(Role.ADMIN))
    try:
        for _ in range(3):
            pending = asyncio.ensure_future(nc.flush(timeout=5))
            await asyncio.sleep(0)  # its PING is out, its PONG not read yet
            pending.cancel()
        await nc.flush(timeout=5)  # answered: the read loop still runs
        sub = await nc.subscribe("test.connect")
        await nc.publish("test.connect", b"still reading")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"still reading"
    finally:
        await nc.close()

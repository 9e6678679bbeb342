"""An idle queue is pulled less and less often, work brings the short pull back,
and a stopping consumer withdraws a long pull at once (real nats-server)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.msg import Msg

from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.consumer import PullLoop, idle_expiry
from streams.definitions import Topology
from streams.provision import ensure_topology
from streams.tasks import stop_task
from tests.waits import until

pytestmark = pytest.mark.connected

STREAM, CONSUMER, SUBJECT = "JETSERVE_REQ", "workers-batch", "jetserve.req.batch"


def is_(cond: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return cond()

    return check


def test_idle_expiry_doubles_only_while_quiet() -> None:
    assert idle_expiry(0.5, 8.0, 0, lambda: True) == 0.5
    assert [idle_expiry(0.5, 8.0, n, lambda: True) for n in (1, 2, 3, 4, 5, 60)] == [
        1.0,
        2.0,
        4.0,
        8.0,
        8.0,
        8.0,
    ]
    assert idle_expiry(0.5, 8.0, 5, lambda: False) == 0.5  # work in flight: short pulls
    assert idle_expiry(0.5, None, 5, lambda: True) == 0.5  # growth off


async def test_empty_pulls_grow_and_a_message_brings_the_short_pull_back(
    nats_server: Service,
) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    gw = await connect(url, "gw", nats_server.bus_auth(Role.GATEWAY))
    wk = await connect(url, "wk", nats_server.bus_auth(Role.WORKER))
    try:
        await ensure_topology(gw.jetstream(), Topology(lanes=16))
        sub = await wk.jetstream().pull_subscribe_bind(CONSUMER, STREAM)
        seen: list[float] = []  # the expiry in force when each message came

        def start(msg: Msg) -> None:
            seen.append(loop.expiry())
            asyncio.get_running_loop().create_task(msg.ack())

        loop = PullLoop(sub, start, poll_s=0.05, idle_poll_s=0.4)
        task = asyncio.create_task(loop.run())
        await until(is_(lambda: loop.expiry() == 0.4), "the cap")  # 0.1, 0.2, then 0.4
        await gw.jetstream().publish(SUBJECT, b"work")
        await until(is_(lambda: len(seen) == 1), "the message")
        assert seen == [0.05]  # the next pull after a message is the short one again
        await stop_task(task)  # its fetch can drop one cancel (streams/tasks.py)
        await loop.hand_back()
    finally:
        await wk.close()
        await gw.close()


async def test_hand_back_withdraws_a_long_pull_without_waiting_for_its_expiry(
    nats_server: Service,
) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    gw = await connect(url, "gw", nats_server.bus_auth(Role.GATEWAY))
    wk = await connect(url, "wk", nats_server.bus_auth(Role.WORKER))
    try:
        await ensure_topology(gw.jetstream(), Topology(lanes=16))
        sub = await wk.jetstream().pull_subscribe_bind(CONSUMER, STREAM)
        loop = PullLoop(sub, lambda msg: None, poll_s=60.0)
        task = asyncio.create_task(loop.run())
        await until(is_(lambda: loop._pull_until > 0), "the pull")  # 60 s, at the server
        await stop_task(task)  # its fetch can drop one cancel (streams/tasks.py)
        await loop.hand_back()
        # Returned long before that pull would expire: it was withdrawn, not waited out.
        assert time.monotonic() < loop._pull_until - 30
        # And the server no longer holds it: new work goes to the next pull, at once,
        # as a first delivery (the withdrawn pull never took it).
        await gw.jetstream().publish(SUBJECT, b"work")
        other = await wk.jetstream().pull_subscribe_bind(CONSUMER, STREAM)
        (msg,) = await other.fetch(1, timeout=10)
        assert msg.data == b"work"
        assert msg.metadata.num_delivered == 1
        await msg.ack()
    finally:
        await wk.close()
        await gw.close()

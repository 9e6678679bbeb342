"""Lanes at scale against a real nats-server: the membership that lane
ownership is computed from (a SIGKILLed worker is forgotten, a clean leave at
once, a join moves ~1/n of the lanes), and the depth reader that sums a class's
hundreds of lane consumers in one consumer list."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.client import Client

from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.definitions import Topology
from streams.depth import read_depths
from streams.membership import MEMBERS_BUCKET, Membership
from streams.provision import await_topology, ensure_topology
from streams.subjects import RequestClass, excess_subject, lane_subject, request_subject
from streams.tasks import stop_task
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(120)]

EVERY_S = 0.25  # heartbeat: a member unheard for 4x this is gone


class Member:
    def __init__(self, nc: Client, worker_id: str) -> None:
        self.m = Membership(nc.jetstream(), worker_id, 1, every_s=EVERY_S)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Member:
        await self.m.start()
        self.task = asyncio.create_task(self.m.run())
        return self

    async def die(self) -> None:
        """As SIGKILL: no goodbye, its bucket entry just stops being refreshed."""
        assert self.task is not None
        await stop_task(self.task)

    async def leave(self) -> None:
        await self.die()
        await self.m.leave()


async def test_members_forget_the_killed_and_the_departed(nats_server: Service) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    conns = [await connect(url, f"w{i}", nats_server.bus_auth(Role.WORKER)) for i in range(4)]
    a, b, c = [await Member(nc, f"w{i}").start() for i, nc in enumerate(conns[:3])]
    try:
        everyone = ("w0", "w1", "w2")
        await until(_sees(everyone, a, b), "all three joined")
        lanes_before = a.m.order(256)

        await c.die()
        # The killed member's entry expires without a delete marker: the
        # heartbeat loop forgets it within ~4 heartbeats.
        await until(_sees(("w0", "w1"), a, b), "w2 forgotten")
        # Its lanes (about a third) moved; the rest stayed with their owners.
        moved = lanes_before.moved(a.m.order(256))
        assert 0.2 <= moved <= 0.45, moved
        assert b.m.order(256) == a.m.order(256)  # both compute the same owners

        d = await Member(conns[3], "w3").start()
        await until(_sees(("w0", "w1", "w3"), a), "w3 joined")
        # A member that leaves cleanly deletes its entry: the watch shows it at once.
        await d.leave()
        await until(_sees(("w0", "w1"), a), "w3 gone")
        kv = await conns[0].jetstream().key_value(MEMBERS_BUCKET)
        assert "w3" not in await kv.keys()  # deleted, not left to expire
    finally:
        for member in (a, b, c):
            with contextlib.suppress(Exception):
                await member.die()
        for nc in conns:
            await nc.close()


def _sees(ids: tuple[str, ...], *members: Member) -> Callable[[], Awaitable[bool]]:
    """A check for :func:`until`: every one of ``members`` sees exactly ``ids``."""

    async def check() -> bool:
        return all(m.m.members == ids for m in members)

    return check


async def test_one_consumer_list_reads_every_lane(nats_server: Service) -> None:
    """256 lanes a class: more consumers than one list page holds."""
    url = f"nats://127.0.0.1:{nats_server.port}"
    admin = await connect(url, "adm", nats_server.bus_auth(Role.GATEWAY))
    try:
        js = admin.jetstream()
        topo = await ensure_topology(js, Topology(lane_load_factor=1.3))
        assert topo.lanes_of(RequestClass.INTERACTIVE) == 256
        assert len(topo.consumer_names(RequestClass.INTERACTIVE)) == 258  # plain, lanes, excess
        # Workers read the lane counts and load factor from the stream, whatever
        # they were told; a gateway configured otherwise keeps the stream's.
        seen = await await_topology(js, Topology(lanes=16))
        assert seen.lanes_of(RequestClass.BATCH) == 256
        assert seen.lane_load_factor == 1.3
        assert (await ensure_topology(js, Topology(lane_load_factor=2.0))).lane_load_factor == 1.3

        sent = {
            request_subject("interactive"): 2,
            lane_subject("interactive", 0): 1,
            lane_subject("interactive", 255): 3,
            excess_subject("interactive"): 4,
            lane_subject("batch", 128): 5,
        }
        for subject, n in sent.items():
            for i in range(n):
                await js.publish(subject, b"{}", headers={"Nats-Msg-Id": f"{subject}-{i}"})
        # One delivered, not acked: ack-pending, not pending.
        sub = await js.pull_subscribe_bind(topo.excess_consumer_name("interactive"), topo.stream)
        (msg,) = await sub.fetch(1, timeout=5)
        assert msg.subject == excess_subject("interactive")

        depths = await read_depths(js, topo)
        assert depths["interactive"].pending == 9
        assert depths["interactive"].ack_pending == 1
        assert depths["interactive"].lag == 10
        assert depths["batch"].pending == 5
        assert depths["embed"].pending == 0
        assert depths["embed"].found
        await msg.ack()
    finally:
        await admin.close()

"""Lane balance tiers through a real nats-server (streams/balance.py): three
workers' lane pullers, their loads as the members bucket carries them. On a
lane, alike: the owner takes it; a cold backup goes before an owner at its
pool's mean (the rule of before kept the owner first); a hot owner after its
backups; a cold owner first again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from jetserve.services import Service
from streams.auth import Role
from streams.balance import HOT_PRIORITY, RANKS
from streams.connect import connect
from streams.definitions import Topology
from streams.membership import Membership
from streams.provision import ensure_topology
from streams.subjects import RequestClass, lane_subject
from streams.tasks import stop_task
from tests.waits import until
from workers.inference.admission import Admission, AdmissionConfig
from workers.inference.affinity import LanePuller

pytestmark = [pytest.mark.connected, pytest.mark.timeout(120)]

CLS = RequestClass.INTERACTIVE
LANES = 16


class Worker:
    def __init__(self, nc: Client, worker_id: str, topo: Topology) -> None:
        self.id = worker_id
        self.load = 0.0  # what it tells the members, requests started per second
        self.served: list[int] = []  # the lanes of what it was handed
        self.members = Membership(nc.jetstream(), worker_id, 1, every_s=0.25, load=self._load)
        self.admission = Admission(AdmissionConfig(max_inflight=4))
        self.puller = LanePuller(
            nc, topo, CLS, 0, self.admission, self.members, self._start, poll_s=0.3
        )
        self.tasks: list[asyncio.Task[None]] = []

    def _load(self) -> float:
        return self.load

    def _start(self, msg: Msg) -> None:
        self.served.append(int(msg.subject.rsplit(".", 1)[-1].lstrip("l")))

        async def done() -> None:
            await msg.ack()
            await self.admission.release()

        self.tasks.append(asyncio.create_task(done()))

    async def start(self) -> None:
        await self.members.start()
        self.tasks += [
            asyncio.create_task(self.members.run()),
            asyncio.create_task(self.puller.run()),
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            await stop_task(task)


def heard(*ws: Worker) -> Callable[[], Awaitable[bool]]:
    """Each knows every member and hears the others' loads as they are now."""

    async def check() -> bool:
        return all(
            len(w.members.members) == len(ws)
            and all(w.members.loads.get(o.id) == o.load for o in ws if o is not w)
            for w in ws
        )

    return check


def grew(w: Worker, before: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return len(w.served) > before

    return check


def pulling(w: Worker, lane: int, want: Callable[[int], bool]) -> Callable[[], Awaitable[bool]]:
    """Two pulls in a row on ``lane`` at a priority ``want`` takes: a pull
    overlaps the one before it a little, so after the second none of another
    priority still stands."""
    first: list[int] = []

    async def check() -> bool:
        at = w.puller.pulled_at(lane)
        if at is None or not want(at):
            first.clear()
            return False
        serial = w.puller._current[lane]  # the lane's newest pull's number
        if not first:
            first.append(serial)
        return serial > first[0]

    return check


async def test_a_hot_owners_lane_goes_to_its_cold_backup(nats_server: Service) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    gw = await connect(url, "gw", nats_server.bus_auth(Role.GATEWAY))
    conns = [await connect(url, f"w{i}", nats_server.bus_auth(Role.WORKER)) for i in range(3)]
    topo = await ensure_topology(gw.jetstream(), Topology(lanes=LANES))
    ws = [Worker(nc, f"w{i}", topo) for i, nc in enumerate(conns)]
    try:
        for w in ws:
            await w.start()
        await until(heard(*ws), "every member, their loads heard")
        orders = ws[0].members.order(LANES).orders
        lane = next(n for n in range(LANES) if orders[n][:2] == ("w0", "w1"))
        owner, backup, third = ws

        # Alike (idle): the owner first.
        await until(pulling(owner, lane, lambda p: p == RANKS), "the owner's normal pull")
        owner_before = len(owner.served)
        await gw.jetstream().publish(lane_subject(CLS, lane), b"{}")
        await until(grew(owner, owner_before), "the owner serving its lane")
        assert backup.served == []

        # The owner at the pool's mean, the backup cold (the third hot): the
        # backup's pull goes first.
        owner.load, backup.load, third.load = 4.0, 0.0, 6.0
        await until(heard(*ws), "the new loads heard")
        await until(pulling(owner, lane, lambda p: p == RANKS), "the owner's normal pull")
        await until(pulling(backup, lane, lambda p: p < RANKS), "the backup's cold pull")
        await gw.jetstream().publish(lane_subject(CLS, lane), b"{}")
        await until(grew(backup, 0), "the cold backup serving the owner's lane")

        # The owner hot, the backup at the mean: the backup still goes first.
        owner.load, backup.load, third.load = 10.0, 3.0, 3.0
        await until(heard(*ws), "the owner's hot load heard")
        await until(pulling(owner, lane, lambda p: p >= HOT_PRIORITY), "the owner's hot pull")
        await until(pulling(backup, lane, lambda p: p == RANKS + 1), "the backup's normal pull")
        await gw.jetstream().publish(lane_subject(CLS, lane), b"{}")
        await until(grew(backup, 1), "the backup serving the hot owner's lane")

        # Reversed: the owner cold, the backup hot: back to the owner.
        owner.load, backup.load, third.load = 0.0, 10.0, 5.0
        await until(heard(*ws), "the reversed loads heard")
        await until(pulling(owner, lane, lambda p: p == 0), "the owner's cold pull")
        owner_before = len(owner.served)
        await gw.jetstream().publish(lane_subject(CLS, lane), b"{}")
        await until(grew(owner, owner_before), "the owner serving its lane again")
        assert backup.served == [lane, lane]
    finally:
        for w in ws:
            with contextlib.suppress(Exception):
                await w.stop()
        for nc in (*conns, gw):
            await nc.close()

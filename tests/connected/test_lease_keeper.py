"""workers/agent/lease_keeper.py against a real nats-server: a step's lease
keeper stops with its step even when the cancel that stops it is dropped.

A NATS node killed under agent runs (tests/faults/test_agent_faults.py) left,
now and then, a keeper running with no step: it renewed the run's lease and
kept its message in progress for good, so every later delivery found the run
busy and the run hung past its deadline. The cancel had landed as a renewal's
reply arrived, and Python 3.11's ``wait_for`` inside nats-py's request returns
the reply then instead of raising (CPython gh-86296)."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from jetserve.services import Service
from streams.agent_store import Lease, RunStore
from streams.agent_topology import DEFAULT_AGENT
from streams.auth import Role
from streams.connect import connect
from tests.waits import until
from workers.agent.lease_keeper import Held, kept

pytestmark = pytest.mark.connected

LEASE_S = 0.6  # renewed every 0.2 s


class DropsOneCancel:
    """The real run store, whose first renewal to be cancelled once its reply
    is in returns the reply instead, as 3.11's ``wait_for`` does in that race."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.renewals = 0
        self.reply_in = asyncio.Event()
        self.dropped = False

    async def renew(self, lease: Lease, ttl_s: float) -> Lease:
        renewed = await self.store.renew(lease, ttl_s)
        self.renewals += 1
        if not self.dropped:
            self.reply_in.set()
            try:
                await asyncio.Event().wait()  # the cancel lands here...
            except asyncio.CancelledError:
                self.dropped = True  # ...and is dropped: the reply is returned
        return renewed


async def _step_message(nc: Client, store: RunStore, run_id: str) -> Msg:
    await store.nudge(run_id, 0)
    sub = await nc.jetstream().pull_subscribe_bind(
        DEFAULT_AGENT.step_consumer, DEFAULT_AGENT.stream
    )
    (msg,) = await sub.fetch(1, timeout=10)
    return msg


async def test_a_keeper_whose_cancel_is_dropped_still_stops_with_its_step(
    nats_server: Service,
) -> None:
    nc = await connect(
        f"nats://127.0.0.1:{nats_server.port}", "lease-keeper", nats_server.bus_auth(Role.ADMIN)
    )
    try:
        store = await RunStore.open(nc, executor=True)
        run_id = "run_keeper"
        msg = await _step_message(nc, store, run_id)
        lease = await store.lease(run_id, "executor-1", LEASE_S)
        assert isinstance(lease, Lease)
        dropping = DropsOneCancel(store)
        held = Held(lease)
        # The step ends while a renewal's reply is in: the keeper is stopped then.
        work = asyncio.create_task(dropping.reply_in.wait())
        async with kept(dropping, msg, held, work, LEASE_S):
            await work

        async def dropped() -> bool:
            return dropping.dropped

        await until(dropped, "the stopping cancel to land in the renewal", bound_s=10)
        renewals = dropping.renewals

        # Nobody renews it any more: the lease runs out and another executor
        # takes the run (a keeper left running would hold it for good).
        async def taken() -> bool:
            return isinstance(await store.lease(run_id, "executor-2", LEASE_S), Lease)

        await until(taken, "the lease to run out", bound_s=20)
        assert dropping.renewals == renewals
        assert not held.lost
        assert held.lease.revision > lease.revision  # the dropped renewal's lease was kept
    finally:
        await nc.close()

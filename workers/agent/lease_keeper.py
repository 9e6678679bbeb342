"""Keeping a run's lease while one step runs.

The keeper renews the lease every third of its length and tells JetStream the
step's message is in progress, so neither the lease nor the message times out
under a long step. It belongs to the step: when the step ends, the keeper is
stopped for certain before the lease is released. A keeper left running would
hold the run's lease and its message for good (each renewal pushes both out):
every later delivery finds the run busy, and the run hangs past its deadline.
A plain ``cancel()`` is not enough for that: Python 3.11's ``wait_for``, inside
nats-py's request, drops a cancel that lands as a renewal's reply arrives
(streams/tasks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import nats.errors
from nats.aio.msg import Msg

from streams.agent_store import Lease
from streams.errors import LeaseLostError, RunStoreError
from streams.tasks import stop_task

log = logging.getLogger(__name__)


class Renews(Protocol):
    """What the keeper needs of the run store (streams/agent_store.py)."""

    async def renew(self, lease: Lease, ttl_s: float) -> Lease: ...


@dataclass
class Held:
    """One message being handled: its lease (renewed) and whether it was lost."""

    lease: Lease
    lost: bool = False


@contextlib.asynccontextmanager
async def kept(
    store: Renews, msg: Msg, held: Held, work: asyncio.Task[Any], lease_s: float
) -> AsyncIterator[None]:
    """Renew ``held``'s lease (and mark ``msg`` in progress) while the block
    runs; on leaving it, no renewal is in flight or to come. A lease taken over
    by someone else sets ``held.lost`` and cancels ``work``: the run is theirs."""
    keeper = asyncio.create_task(_keep(store, msg, held, work, lease_s))
    try:
        yield
    finally:
        await stop_task(keeper)


async def _keep(
    store: Renews, msg: Msg, held: Held, work: asyncio.Task[Any], lease_s: float
) -> None:
    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            held.lease = await store.renew(held.lease, lease_s)
        except LeaseLostError:
            log.warning("run %s: lease lost; stopping this step", held.lease.run_id)
            held.lost = True
            work.cancel()
            return
        except RunStoreError as exc:  # transient: the next renewal may work
            log.warning("run %s: lease renewal failed: %s", held.lease.run_id, exc.message)
            continue
        with contextlib.suppress(nats.errors.Error):
            await msg.in_progress()

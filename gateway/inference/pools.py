"""Which deployment pool a routed request goes to (streams/pools.py).

A request whose route names candidate deployments goes to the pool of the
first candidate that has a live worker, as the workers' membership bucket says
(followed read-only), else to the first candidate's (it waits there for a
worker: a pool scaled to zero comes back on its queue depth). The pool's
consumers are made on first use, once per process, so a route applied at any
time is served without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
from nats.js import JetStreamContext

from gateway.errors import Unavailable
from streams.definitions import Topology
from streams.errors import ProvisioningError
from streams.membership import Membership, follow_members
from streams.provision import ensure_pool
from streams.tasks import stop_task

log = logging.getLogger(__name__)

RETRY_S = 2.0  # before the bucket exists (no worker yet): look again this often


class PoolView:
    def __init__(self, js: JetStreamContext, topology: Topology) -> None:
        self._js = js
        self._topo = topology
        self._members: Membership | None = None
        self._made: dict[str, str] = {}  # deployment -> its pool token, consumers made
        self._making: dict[str, asyncio.Lock] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="pool-view")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                view = await follow_members(self._js, self._topo.replicas)
                if view is not None:
                    self._members = view
                    await view.run()  # until stopped; a bus error looks again
            self._members = None
            await asyncio.sleep(RETRY_S)

    def workers(self) -> dict[str, int]:
        """Live workers per deployment, as last seen (for the metrics)."""
        members = self._members
        return {dep: len(ms) for dep, ms in members.pools.items()} if members else {}

    def choose(self, candidates: list[str]) -> str:
        """The candidate whose pool the request goes to."""
        members = self._members
        if members is not None:
            for dep in candidates:
                if members.live(dep):
                    return dep
        return candidates[0]

    async def token(self, deployment: str) -> str:
        """``deployment``'s pool token, its consumers made (once per process)."""
        made = self._made.get(deployment)
        if made is not None:
            return made
        lock = self._making.setdefault(deployment, asyncio.Lock())
        async with lock:
            if deployment not in self._made:
                try:
                    self._made[deployment] = await ensure_pool(self._js, self._topo, deployment)
                except (nats.errors.Error, TimeoutError, ProvisioningError) as exc:
                    log.warning("cannot make the pool of %s: %r", deployment, exc)
                    raise Unavailable(
                        "The deployment's queue could not be set up.", code="bus_unavailable"
                    ) from exc
            return self._made[deployment]

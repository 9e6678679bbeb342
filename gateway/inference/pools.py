"""Which deployment pool a routed request goes to (streams/pools.py), and the
pools themselves.

A request whose route names candidate deployments goes to the pool of the
first candidate that has a live worker, as the workers' membership bucket says
(followed read-only), else to the first candidate's (it waits there for a
worker: a pool scaled to zero comes back on its queue depth). Every gateway
makes the pool of every candidate of every route as the route table shows them
(checked every ``every_s``), and on first use, so a route applied at any time
is served without a restart, and a worker's fallback to the next candidate
lands in a pool that exists. Workers only pull pools (workers/inference/
pool_source.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
from nats.js import JetStreamContext

from gateway.errors import Unavailable
from gateway.inference.route_table import RouteTable
from streams.definitions import Topology
from streams.errors import ProvisioningError
from streams.membership import Membership, follow_members
from streams.provision import ensure_pool
from streams.tasks import stop_task

log = logging.getLogger(__name__)

RETRY_S = 2.0  # before the bucket exists (no worker yet): look again this often
PROVISION_EVERY_S = 1.0  # how often the route table is checked for new candidates


class PoolView:
    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        routes: RouteTable | None = None,
        every_s: float = PROVISION_EVERY_S,
    ) -> None:
        self._js = js
        self._topo = topology
        self._routes = routes
        self._every = every_s
        self._members: Membership | None = None
        self._made: dict[str, str] = {}  # deployment -> its pool token, consumers made
        self._making: dict[str, asyncio.Lock] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(), name="pool-view"),
            asyncio.create_task(self._provision(), name="pool-provision"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            await stop_task(task)

    async def _provision(self) -> None:
        """The pools of every route's candidates (cheap when nothing is new)."""
        while True:
            if self._routes is not None:
                for name in self._routes.names():
                    record = self._routes.get(name)
                    for dep in record.contract.candidates if record is not None else ():
                        if dep.name not in self._made:
                            with contextlib.suppress(Unavailable):  # tried again next round
                                await self.token(dep.name)
            await asyncio.sleep(self._every)

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

    def engine_versions(self, deployment: str) -> tuple[str, ...] | None:
        """What ``deployment``'s live workers report of their engines; None: no
        view of the members yet."""
        members = self._members
        return members.engine_versions(deployment) if members is not None else None

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

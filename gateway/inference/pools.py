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
pool_source.py).

A request for a LoRA adapter goes to the adapter pool (streams.pools.
adapter_pool) of the first candidate whose worker holds the adapter, as the
workers advertise (a request outside any route: of any deployment that does).
Adapter pools are made for every route's candidates and adapters, and for every
adapter a live worker advertises."""

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
from streams.pools import adapter_pool
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
                    if record is None:
                        continue
                    for dep in record.contract.candidates:
                        for pool in (
                            dep.name,
                            *(adapter_pool(dep.name, a) for a in record.contract.adapters),
                        ):
                            if pool not in self._made:
                                with contextlib.suppress(Unavailable):  # tried again next round
                                    await self.token(pool)
            members = self._members
            # The adapter pools of live workers: their requests need no route.
            for pool in list(members.pools) if members is not None else ():
                if "@" in pool and pool not in self._made:
                    with contextlib.suppress(Unavailable):
                        await self.token(pool)
            await asyncio.sleep(self._every)

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                view = await follow_members(
                    self._js, self._topo.replicas, self._topo.lane_load_factor
                )
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

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters live workers hold -> their base model."""
        members = self._members
        if members is None:
            return {}
        return {a.name: a.parent for info in members.serving.values() for a in info.adapters}

    def live(self, pool: str) -> bool:
        members = self._members
        return members is not None and members.live(pool)

    def served_models(self) -> set[str] | None:
        """The base models live workers' engines serve; None when this gateway
        cannot tell: it does not follow the members yet (no worker has made
        the bucket), or a live worker cannot say (it may serve anything)."""
        members = self._members
        if members is None:
            return None
        served: set[str] = set()
        for info in members.serving.values():
            if not info.models:
                return None
            served.update(info.models)
        return served

    def holders(self, adapter: str, candidates: list[str]) -> list[str]:
        """The deployments (of ``candidates``, in order; empty: any, by name)
        with a live worker holding ``adapter``."""
        members = self._members
        if members is None:
            return []
        if not candidates:
            candidates = sorted(
                info.deployment
                for info in members.serving.values()
                if any(a.name == adapter for a in info.adapters)
            )
        return [d for d in dict.fromkeys(candidates) if members.live(adapter_pool(d, adapter))]

    def choose_adapter(self, adapter: str, candidates: list[str]) -> str:
        """The adapter pool the request goes to; Unavailable when no live
        worker holds the adapter (it was there at admission: it just left)."""
        holders = self.holders(adapter, candidates)
        if not holders:
            raise adapter_unavailable(adapter)
        return adapter_pool(holders[0], adapter)

    def choose(self, candidates: list[str]) -> str:
        """The candidate whose pool the request goes to."""
        members = self._members
        if members is not None:
            for dep in candidates:
                if members.live(dep):
                    return dep
        return candidates[0]

    def deployment_of(self, token: str) -> str | None:
        """The deployment (or adapter pool) whose pool ``token`` is, if this
        gateway made it (for the metrics' labels)."""
        return next((dep for dep, made in self._made.items() if made == token), None)

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


def adapter_unavailable(adapter: str) -> Unavailable:
    return Unavailable(
        f"No live replica holds the adapter '{adapter}': none of its deployments' "
        "workers advertises it now.",
        code="adapter_unavailable",
        param="model",
    )

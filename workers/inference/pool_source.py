"""A worker's deployment pool (streams/pools.py), pulled once it exists.

A worker does not make its pool: the gateway does, when a route first names
the deployment (a worker of a deployment no route names has nothing routed to
serve). So the worker looks for the pool's consumers every ``every_s`` (one
JetStream API call) until they are there, then runs its pullers of them: the
pool's plain consumer per class and its lanes. A route applied while the worker
runs reaches it within ``every_s``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from streams.consumer import Source
from streams.definitions import Topology
from streams.pools import pool_consumer_name, pool_token

LOOK_EVERY_S = 2.0


class PoolSource:
    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        deployment: str,
        make: Callable[[str, str], Awaitable[list[Source]]],
        every_s: float = LOOK_EVERY_S,
    ) -> None:
        self._js = js
        self._topo = topology
        self._deployment = deployment
        self._token = pool_token(deployment)
        self._make = make  # (token, deployment) -> the pool's pullers
        self._every = every_s
        self._sources: list[Source] = []
        self.attached = asyncio.Event()

    async def run(self) -> None:
        # The gateway makes a pool's lanes first and its plain consumers last.
        last_cls = self._topo.classes[-1]
        last = pool_consumer_name(self._token, last_cls)
        while True:
            try:
                await self._js.consumer_info(self._topo.stream_of(last_cls), last)
                break
            except (NotFoundError, nats.errors.Error, TimeoutError):
                await asyncio.sleep(self._every)
        self._sources = await self._make(self._token, self._deployment)
        self.attached.set()
        async with asyncio.TaskGroup() as tg:
            for source in self._sources:
                tg.create_task(source.run())

    @property
    def sources(self) -> tuple[Source, ...]:
        """Its pullers, once the pool exists."""
        return tuple(self._sources)

    async def hand_back(self) -> None:
        await asyncio.gather(*(source.hand_back() for source in self._sources))

"""The tasks of a NATS ingress: one per message, owned (awaited at stop), and
bounded while their caller is not yet known.

A service's requests arrive on subscriptions of ours, not on sockets, so nothing
else limits how many wait for their key's lookup at once. A task per message made
a flood of made-up keys, while the key store was slow (a lookup may wait for the
Redis timeout), cost memory of bandwidth x lookup time. Now at most ``limit``
messages are unauthenticated at once; past it the subscription's callback waits
for one of them to be authenticated or to end, and what arrives meanwhile waits in
the subscription's pending buffer, which nats-py bounds (:data:`PENDING_MSGS`,
:data:`PENDING_BYTES`; past it the message is dropped as a slow consumer's,
counted in the log, and its caller's request times out). At shutdown what still
waits there is dropped the same way. Once authenticated, a request counts against its tenant's
bound instead (gateway/tenancy/tenant_slots.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

# What each ingress subscription buffers while the ingress waits: nats-py's
# defaults are 128 MiB of bodies and 524,288 messages a subscription, and it
# counts bodies only (headers and each message's own cost, ~1 KB, not at all):
# a flood of tiny messages queued gigabytes under the byte bound alone.
PENDING_BYTES = 32 * 1024 * 1024
PENDING_MSGS = 2048

Known = Callable[[], None]  # called once the message's caller is authenticated


class Counted(Protocol):
    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...


class IngressTasks:
    def __init__(self, limit: int, gauge: Counted | None = None) -> None:
        if limit < 1:
            raise ValueError("the unauthenticated limit must be at least 1")
        self.tasks: set[asyncio.Task[None]] = set()
        self.unauthenticated = 0
        self._gauge = gauge
        self._free = asyncio.Semaphore(limit)

    async def spawn(self, serve: Callable[[Known], Coroutine[Any, Any, None]]) -> None:
        """Serve one message in its own task, once fewer than ``limit`` are
        unauthenticated (the caller, a subscription callback, waits till then)."""
        await self._free.acquire()
        self.unauthenticated += 1
        if self._gauge is not None:
            self._gauge.inc()
        released = False

        def known() -> None:
            nonlocal released
            if not released:
                released = True
                self.unauthenticated -= 1
                if self._gauge is not None:
                    self._gauge.dec()
                self._free.release()

        def ended(task: asyncio.Task[None]) -> None:
            # Also for a task cancelled before it first ran (at stop).
            known()
            self.tasks.discard(task)

        task = asyncio.create_task(serve(known))
        self.tasks.add(task)
        task.add_done_callback(ended)

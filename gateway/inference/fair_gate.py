"""Fair shares between tenants within a class (issue 15).

A class's work queue is first come, first served, so a tenant that floods a
class puts its whole queue in front of everyone else's, and shedding, which
judges the one queue, then refuses the others too. So the gateway keeps the
class's queue in JetStream short and holds here what would lengthen it, one
queue per tenant, released in turn.

- **Short.** The class's backlog estimate is the queue watch's last look
  (``num_pending`` of the class's consumers) plus what this gateway published
  since, less what the fleet started meanwhile at its measured rate. It is kept
  under ``target`` = max(:data:`MIN_BACKLOG`, rate x :data:`TARGET_WAIT_S`).
  The gate engages only once a look finds the queue at the target or past it,
  at a known rate: until then (light load, workers that keep up) a request
  passes at once, at no cost. Engaged, it releases at the fleet's measured start
  rate, faster each time a look finds the queue emptied while requests wait.
- **In turn.** Start-time fair queueing: a request is tagged max(virtual time,
  its tenant's last tag) + 1, and the smallest tag goes first. A tenant with one
  request waiting goes before another tenant's thousandth.
- **Refused early, by its own queue.** A request whose turn would come past its
  deadline (the backlog, plus its place in its tenant's queue times the tenants
  waiting, at the class's start rate) gets 429 ``deadline_unmeetable`` at once.
  One that waits past its deadline anyway ends 504 ``deadline_exceeded``.
  Neither was published; both are recorded as refusals.
- **Bounded.** At most :data:`MAX_WAITING` requests per tenant and class wait
  here; past that, 429 ``tenant_queue_full``.
- **Replicas.** Each gateway gates its own requests against the one backlog
  (JetStream's): N gateways may overfill it by what they publish between two
  looks, at most N x target. A tenant spread over every replica is held on each.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import GatewayError, RateLimited
from gateway.inference.shedding import SAFETY, ClassLoad, QueueWatch
from streams.tasks import stop_task

MIN_BACKLOG = 2  # messages the class's queue may hold before requests wait here
TARGET_WAIT_S = 0.2  # ...or this long of the fleet's starts, when more
MAX_WAITING = 1024  # per tenant and class
IDLE_CHECK_S = 0.05  # how often a gate without a rate looks again


class DeadlinePassed(GatewayError):
    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


@dataclass(order=True)
class _Waiter:
    tag: float
    seq: int
    tenant: str = field(compare=False)
    turn: asyncio.Future[None] = field(compare=False)


class _ClassGate:
    def __init__(self, cls: str, watch: QueueWatch, report: Callable[[str, int], None]) -> None:
        self.cls = cls
        self._watch = watch
        self._report = report
        self._queues: dict[str, deque[_Waiter]] = {}
        self._last_tag: dict[str, float] = {}
        self._vtime = 0.0
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._waiting = 0
        self._pace = 0.0  # releases per second while requests wait here
        self._look = 0.0  # the queue watch's look the pace last followed
        self.released = 0  # requests that waited here, then went (metrics, tests)

    @property
    def waiting(self) -> int:
        return self._waiting

    def _count(self, delta: int) -> None:
        self._waiting += delta
        self._report(self.cls, self._waiting)

    # -- the backlog ------------------------------------------------------------
    def _class_load(self) -> ClassLoad | None:
        return self._watch.loads.get(self.cls)

    def _target(self) -> float:
        return max(float(MIN_BACKLOG), self._pace * TARGET_WAIT_S)

    def _engaged(self) -> bool:
        """The class is backed up: the last look found its queue at the target or
        past it, at a known start rate. Workers that keep up leave no queue, and
        then nobody waits here."""
        load = self._class_load()
        if load is None or load.rate is None:
            return False
        if not self._pace:
            self._pace = load.rate
        return load.depth >= self._target()

    def _follow_looks(self) -> None:
        """At each new look of the queue watch, the release pace: the fleet's
        measured start rate while the queue was not empty; faster each time a look
        finds it emptied while requests wait here (the pace was too slow, and an
        empty queue measures no rate)."""
        load = self._class_load()
        if load is None or load.at == self._look:
            return
        self._look = load.at
        if load.depth == 0:
            self._pace = max(self._pace * 1.5, self._pace + 2 * MIN_BACKLOG)
        elif load.rate:
            self._pace = load.rate

    def _backlog(self) -> float:
        """The class's queue now: the last look, plus what this gateway published
        since, less what the fleet started since at the release pace."""
        load = self._class_load()
        if load is None:
            return 0.0
        backlog = float(load.depth + load.since)
        if self._pace and load.at:
            backlog -= self._pace * (time.monotonic() - load.at)
        return max(0.0, backlog)

    # -- entering -------------------------------------------------------------
    async def enter(self, tenant: str, deadline: float) -> None:
        if not self.waiting and not self._engaged():
            self._watch.published(self.cls)
            return
        queue = self._queues.setdefault(tenant, deque())
        if len(queue) >= MAX_WAITING:
            raise RateLimited(
                "Too many of this tenant's requests are waiting in this class; retry later.",
                code="tenant_queue_full",
                retry_after=1.0,
            )
        self._refuse_if_late(tenant, len(queue), deadline)
        tag = max(self._vtime, self._last_tag.get(tenant, 0.0)) + 1.0
        self._last_tag[tenant] = tag
        self._seq += 1
        waiter = _Waiter(tag, self._seq, tenant, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        self._count(1)
        self._ensure_releasing()
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                await asyncio.shield(waiter.turn)
        except TimeoutError:
            raise DeadlinePassed(
                "The request's deadline passed while it waited for its tenant's turn."
            ) from None
        finally:
            if not waiter.turn.done():  # timed out or cancelled: out of the queue
                waiter.turn.cancel()
                queue.remove(waiter)  # still its queue: a queue leaves the map only empty
                self._count(-1)
                if not queue and self._queues.get(tenant) is queue:
                    del self._queues[tenant]

    def _refuse_if_late(self, tenant: str, ahead: int, deadline: float) -> None:
        if not self._pace:
            return  # never shed blind
        tenants = len(self._queues.keys() | {tenant})
        wait = (self._backlog() + (ahead + 1) * tenants) / self._pace
        left = deadline - time.time()
        if wait > SAFETY * left:
            raise RateLimited(
                "This tenant's requests ahead in its class would outlast this one's "
                "deadline; retry later.",
                code="deadline_unmeetable",
                retry_after=min(30.0, max(1.0, wait - SAFETY * left)),
            )

    # -- releasing ------------------------------------------------------------
    def _ensure_releasing(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._release(), name=f"fair-gate-{self.cls}")

    async def _release(self) -> None:
        while self.waiting:
            self._follow_looks()
            if self._backlog() < self._target():
                self._release_one()
                continue
            await asyncio.sleep(min(0.25, 1.0 / self._pace) if self._pace else IDLE_CHECK_S)

    def _release_one(self) -> None:
        heads = [q[0] for q in self._queues.values() if q]
        waiter = min(heads)
        queue = self._queues[waiter.tenant]
        queue.popleft()
        if not queue:
            self._queues.pop(waiter.tenant, None)
        self._count(-1)
        self._vtime = waiter.tag
        self.released += 1
        self._watch.published(self.cls)  # counted in the backlog from now on
        waiter.turn.set_result(None)

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)


class FairGate:
    """One :class:`_ClassGate` per class, made on first use."""

    def __init__(
        self, watch: QueueWatch, report: Callable[[str, int], None] = lambda cls, n: None
    ) -> None:
        self._watch = watch
        self._report = report  # (class, requests waiting now): the gateway's gauge
        self._gates: dict[str, _ClassGate] = {}

    def of(self, cls: str) -> _ClassGate:
        gate = self._gates.get(cls)
        if gate is None:
            gate = self._gates[cls] = _ClassGate(cls, self._watch, self._report)
        return gate

    async def enter(self, cls: str, tenant: str, deadline: float) -> None:
        """Return when this request may be published (at once, mostly); raise a
        429 or 504 refusal when its turn would come, or came, too late."""
        await self.of(cls).enter(tenant, deadline)

    async def stop(self) -> None:
        for gate in self._gates.values():
            await gate.stop()

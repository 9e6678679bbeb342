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
  its tenant's last tag) + 1 / weight (the tenant's ``weight`` in its limits,
  default 1), and the smallest tag goes first. A tenant with one request
  waiting goes before another tenant's thousandth; a tenant of weight 2 gets
  two turns for one of weight 1.
- **Apart.** What waited here while more of its tenant's wait behind it (a
  flood) goes to the class's excess subject, which workers
  serve only with slots no in-turn request of the class waits for, and whose
  pullers hold no slot while they wait (workers/inference/admission.py); a
  request of a tenant not ahead of the virtual time (nothing of its waiting
  here, its tag at most :data:`IN_TURN_BURST` turns past the virtual time: a
  light tenant's short burst) is in turn: it passes at once, to the class's own
  subject, whose puller on every worker holds a slot ready for it. So a tenant
  sending in turn is not queued behind a flood, in JetStream either. The price:
  while another tenant is around, a flood gets one slot less per worker and
  class. A tenant alone in the class (no other seen here for :data:`ALONE_S`)
  keeps the class's own subject, and every slot.
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
from typing import Any

from gateway.errors import ClientLeft, GatewayError, RateLimited
from gateway.inference.shedding import SAFETY, ClassLoad, QueueWatch
from streams.tasks import stop_task

MIN_BACKLOG = 2  # messages the class's queue may hold before requests wait here
TARGET_WAIT_S = 0.2  # ...or this long of the fleet's starts, when more
MAX_WAITING = 1024  # per tenant and class
IDLE_CHECK_S = 0.05  # how often a gate without a rate looks again
ALONE_S = 30.0  # a tenant is alone in its class when no other entered for this long
# How far past the virtual time a tenant with nothing waiting may run and still
# pass at once. 1 would hold a light tenant's second request of a turn (two
# arrivals close together) until the next release, which a saturated class
# makes only as a running request ends.
IN_TURN_BURST = 4.0


class DeadlinePassed(GatewayError):
    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


@dataclass(order=True)
class _Waiter:
    tag: float
    seq: int
    tenant: str = field(compare=False)
    turn: asyncio.Future[bool] = field(compare=False)  # True: more of its tenant's wait


class _ClassGate:
    def __init__(
        self,
        cls: str,
        watch: QueueWatch,
        report: Callable[[str, int], None],
        passed: Callable[[str, str], None],
        burst: float = IN_TURN_BURST,
    ) -> None:
        self.cls = cls
        self._burst = burst
        self._watch = watch
        self._report = report
        self._passed = passed
        self._queues: dict[str, deque[_Waiter]] = {}
        self._last_tag: dict[str, float] = {}
        self._vtime = 0.0
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._waiting = 0
        self._pace = 0.0  # releases per second while requests wait here
        self._look = 0.0  # the queue watch's look the pace last followed
        self.released = 0  # requests that waited here, then went (metrics, tests)
        self.in_turn = 0  # requests that passed at once while the gate was engaged
        self.excess = 0  # requests sent to the excess subject
        self._seen: dict[str, float] = {}  # tenant -> when it last entered (monotonic)
        self._pruned = 0.0

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

    # -- tenants around ----------------------------------------------------------
    def _met(self, tenant: str) -> None:
        now = time.monotonic()
        self._seen[tenant] = now
        if now - self._pruned < 1.0:
            return
        self._pruned = now
        for t, at in list(self._seen.items()):
            if now - at >= ALONE_S and t not in self._queues:
                del self._seen[t]
                if self._last_tag.get(t, 0.0) <= self._vtime:
                    self._last_tag.pop(t, None)  # nothing owed: forgotten

    def _others_around(self, tenant: str) -> bool:
        now = time.monotonic()
        return any(t != tenant and now - at < ALONE_S for t, at in self._seen.items())

    # -- entering -------------------------------------------------------------
    async def enter(
        self,
        tenant: str,
        deadline: float,
        weight: float = 1.0,
        service_s: float = 0.0,
        gone: asyncio.Event | None = None,
    ) -> bool:
        """Whether the request goes to the class's excess subject."""
        step = 1.0 / weight
        self._met(tenant)
        if not self.waiting and not self._engaged():
            self._watch.published(self.cls)
            return False
        queue = self._queues.get(tenant)
        last = self._last_tag.get(tenant, 0.0)
        if not queue and last + step <= self._vtime + self._burst:
            # In turn: its tag is within the burst of the virtual time; it goes
            # now, and is charged.
            self._last_tag[tenant] = max(self._vtime, last) + step
            self.in_turn += 1
            self._passed(self.cls, "in_turn")
            self._watch.published(self.cls)
            return False
        # Into the map only with its waiter: a refusal below must not leave an
        # empty queue behind, counted as a tenant waiting by every estimate after.
        queue = self._queues.get(tenant) or deque()
        if len(queue) >= MAX_WAITING:
            raise RateLimited(
                "Too many of this tenant's requests are waiting in this class; retry later.",
                code="tenant_queue_full",
                retry_after=1.0,
            )
        self._refuse_if_late(tenant, len(queue), deadline, service_s)
        tag = max(self._vtime, self._last_tag.get(tenant, 0.0)) + step
        self._last_tag[tenant] = tag
        self._seq += 1
        waiter = _Waiter(tag, self._seq, tenant, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        self._queues[tenant] = queue
        self._count(1)
        self._ensure_releasing()
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                backlogged = await _turn_or_gone(waiter.turn, gone)
        except TimeoutError:
            raise DeadlinePassed(
                "The request's deadline passed while it waited for its tenant's turn."
            ) from None
        except ClientLeft:
            self._passed(self.cls, "left")
            raise
        finally:
            if not waiter.turn.done():  # timed out or cancelled: out of the queue
                waiter.turn.cancel()
                queue.remove(waiter)  # still its queue: a queue leaves the map only empty
                self._count(-1)
                if not queue and self._queues.get(tenant) is queue:
                    del self._queues[tenant]
        # Apart only a tenant with more of its own waiting (a flood): one that
        # waited only because it came twice within a turn goes in turn now.
        apart = backlogged and self._others_around(tenant)
        self.excess += apart
        self._passed(self.cls, "excess" if apart else "waited")
        return apart

    def _refuse_if_late(
        self, tenant: str, ahead: int, deadline: float, service_s: float = 0.0
    ) -> None:
        """``service_s``: what the answer takes once its turn came (the class's
        median first-token delay and answer time), as the shedder counts it: a
        request that would start in time but not finish only fails later, 504."""
        if not self._pace:
            return  # never shed blind
        tenants = len(self._queues.keys() | {tenant})
        wait = (self._backlog() + (ahead + 1) * tenants) / self._pace + service_s
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
        waiter.turn.set_result(bool(queue))

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)


async def _turn_or_gone(turn: asyncio.Future[bool], gone: asyncio.Event | None) -> bool:
    """The turn's answer; ClientLeft if the client hung up first (its request
    leaves the queue unpublished: published, it was only cancelled at once by id)."""
    if gone is None:
        return await asyncio.shield(turn)
    left = asyncio.ensure_future(gone.wait())
    either: set[asyncio.Future[Any]] = {turn, left}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if turn.done():
        return turn.result()  # its turn came: the publish watches ``gone`` from here
    raise ClientLeft("The client left while its request waited for its tenant's turn.")


class FairGate:
    """One :class:`_ClassGate` per class, made on first use."""

    def __init__(
        self,
        watch: QueueWatch,
        report: Callable[[str, int], None] = lambda cls, n: None,
        passed: Callable[[str, str], None] = lambda cls, way: None,
        burst: float = IN_TURN_BURST,
    ) -> None:
        self._burst = burst  # turns a tenant with nothing waiting may run ahead
        self._watch = watch
        self._report = report  # (class, requests waiting now): the gateway's gauge
        self._passed = passed  # (class, way): a request let go while engaged
        self._gates: dict[str, _ClassGate] = {}

    def of(self, cls: str) -> _ClassGate:
        gate = self._gates.get(cls)
        if gate is None:
            gate = self._gates[cls] = _ClassGate(
                cls, self._watch, self._report, self._passed, self._burst
            )
        return gate

    async def enter(
        self,
        cls: str,
        tenant: str,
        deadline: float,
        weight: float = 1.0,
        service_s: float = 0.0,
        gone: asyncio.Event | None = None,
    ) -> bool:
        """Return when this request may be published (at once, mostly): whether
        to the class's excess subject. Raise a 429 or 504 refusal when its turn
        would come, or came, too late, and 499 when ``gone`` is set (the client
        hung up) while it waits. ``weight``: the tenant's share weight;
        ``service_s``: the answer's expected time once started."""
        return await self.of(cls).enter(tenant, deadline, weight, service_s, gone)

    async def stop(self) -> None:
        for gate in self._gates.values():
            await gate.stop()

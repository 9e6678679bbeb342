"""Identical-prompt coalescing: temperature-0 requests that are byte-for-byte the
same request share one upstream execution.

At temperature 0 an engine decodes greedily, so identical requests get identical
output; running the same prompt N times spends N prefills and N decodes for one
answer. When the route allows it (``CoalescePolicy.enabled``; ``--coalesce``
for models without a route contract), a request that arrives while an identical
one is in flight *follows* it instead of being published.

Eligible: chat and completion requests with ``temperature == 0`` and ``n`` 1
(or unset), not on the idempotency path (a client ``Idempotency-Key`` already
has its own dedupe, and its id may already sit in the queue). Tools are fine:
the model's output, tool calls included, is deterministic at T=0, and executing
a tool is each client's own act, so no side effect is shared or suppressed.

Key: (tenant, sha256 of the canonical request: op, class, the body minus
``stream``/``stream_options``/``user``/``metadata``, and the engine-facing
headers). Another tenant never shares an execution unless the route marks the
prefix shared (``cross_tenant``), then the tenant drops out of the key.

Every member (the leader included) is its own accepted request: own request id,
budget hold, ledger record. One pump reads the upstream :class:`FrameStream`
(liveness, gap recovery and hedging stay there) and fans its events out to each
member's own bounded queue; late joiners get the tokens so far replayed first.
A member that leaves (disconnect, too slow) only detaches; the last one to
leave cancels the upstream.

Charging: exactly one member pays for the execution - the payer, first the
leader. If the payer leaves while the execution continues for others, the
payer role moves to the oldest remaining member, and the leaver is charged
nothing; every other member is charged nothing. Each follower's ledger record
carries ``coalesced_with`` = the leader's request id (the execution's id, the
one the worker and engine saw), so the records of one execution are those
with ``request_id == X or coalesced_with == X``, and their charges sum to one
execution's cost.

Across replicas (gateway/inference/coalesce_fleet.py): a replica with no group
for the key asks Redis. It leads (publishes, as above) or follows another
replica's execution through its frames capture, as one more group; the groups
of all replicas share the stopping rule and the one charge.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec

from gateway.errors import GatewayError
from gateway.inference.coalesce_fleet import FOLLOW_WAIT_S, Claim, FleetCoalescing
from gateway.inference.dispatch import Dispatcher, FrameStream
from streams.inference.frames import Event, FrameBuffer, FrameReader
from streams.routes import CoalescePolicy
from streams.wire import ErrorFrame, Final, Heartbeat, InferenceRequest, Token

log = logging.getLogger(__name__)

# Fields that change the transport or bookkeeping, not what the engine computes.
IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata"})
# A follower accepts the leader's deadline when it is at most this much earlier
# than its own (requests that arrive together differ by milliseconds).
DEADLINE_SLACK_S = 1.0

# Publish the request; its argument says whether it may be shared (a group's
# leader's): a shared request is not cancelled by id when its own client hangs
# up while it is queued (the members that joined meanwhile read it).
Submit = Callable[[bool], Awaitable[FrameStream]]


def coalesce_key(req: InferenceRequest, policy: CoalescePolicy | None) -> str | None:
    """The key identical requests share, or None when this one may not coalesce."""
    if policy is None or not policy.enabled or req.op == "embedding":
        return None
    body = req.body
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return None  # unset means the engine's default (1.0): sampled
    if temperature != 0 or body.get("n") not in (None, 1):
        return None
    canonical = {
        "op": req.op,
        "cls": req.cls,
        "body": {k: v for k, v in body.items() if k not in IGNORED_FIELDS},
        "headers": {k.lower(): v for k, v in req.headers.items()},
        # Where it may run: a request under a route's new revision (a rollback
        # away from a deployment) joined one in flight under the old, and was
        # served by the deployment the change was meant to stop.
        "route": [req.route, req.route_revision, req.candidates, req.adapter],
    }
    digest = hashlib.sha256(msgspec.json.encode(canonical, order="sorted")).hexdigest()
    scope = "*" if policy.cross_tenant else req.tenant
    return f"{scope}/{digest}"


class Coalescer:
    """Owns the in-flight groups and their pump tasks (awaited in :meth:`aclose`)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        heartbeat_timeout_s: float,
        max_buffered: int,
        on_coalesced: Callable[[], None] = lambda: None,
        fleet: FleetCoalescing | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.fleet = fleet  # None: this replica's own requests only
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_buffered = max_buffered
        self.on_coalesced = on_coalesced  # one per follower (the gateway's counter)
        self._groups: dict[str, _Group] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(
        self, req: InferenceRequest, policy: CoalescePolicy | None, submit: Submit
    ) -> FrameStream:
        """Follow an identical in-flight request, or run ``submit`` and lead."""
        key = coalesce_key(req, policy)
        if key is None:
            return await submit(False)
        group = self._groups.get(key)
        if group is not None:
            await group.ready.wait()
            if group.joinable(req, self.max_buffered):
                self.on_coalesced()
                return group.join(req)
        group = _Group(self, key, req.deadline)
        self._groups[key] = group  # identical requests arriving now wait for it
        try:
            upstream = await self._upstream(group, req, submit)
        except BaseException:
            self._drop(group)
            group.ready.set()  # they find it unjoinable and submit on their own
            raise
        group.upstream = upstream
        group.ready.set()
        if upstream.duplicate:
            self._drop(group)  # a retried id: JetStream already holds it, nothing to share
            return upstream
        member = group.join(req)
        group.pump_task = self._own(group.pump(), f"coalesce-{req.id}")
        return member

    async def _upstream(self, group: _Group, req: InferenceRequest, submit: Submit) -> FrameStream:
        """Lead (publish) or follow another replica's execution of this key."""
        if self.fleet is None:
            return await submit(True)
        claim = await self.fleet.claim(
            group.key, req.id, req.tenant, req.deadline, req.deadline - DEADLINE_SLACK_S
        )
        if claim.kind == "follow":
            followed = await self._follow(claim)
            if followed is not None:
                group.fleet = "follow"
                self.on_coalesced()
                return followed
            await self.fleet.leave(group.key, claim.request_id, leads=False)
            return await submit(True)  # its own: the other's capture never came
        if claim.kind != "lead":
            return await submit(True)
        try:
            upstream = await submit(True)
        except BaseException:
            await self.fleet.end(group.key, req.id)
            raise
        group.fleet = "lead"
        return upstream

    async def _follow(self, claim: Claim) -> FrameStream | None:
        """The leader's frames capture, from its head frame; None when it has not
        reached the capture within FOLLOW_WAIT_S (or the bus is unavailable)."""
        give_up = time.monotonic() + FOLLOW_WAIT_S
        while True:
            try:
                stream = await self.dispatcher.resume(
                    claim.tenant, claim.request_id, 0, follower=True
                )
            except GatewayError:
                return None
            if stream is not None or time.monotonic() >= give_up:
                return stream
            await asyncio.sleep(0.05)  # the leader is between its claim and its publish

    def _drop(self, group: _Group) -> None:
        if self._groups.get(group.key) is group:
            del self._groups[group.key]

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        """Stop pumping: members still attached see their stream end as interrupted."""
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


class _Group:
    def __init__(self, owner: Coalescer, key: str, deadline: float) -> None:
        self.owner = owner
        self.key = key
        self.deadline = deadline
        self.ready = asyncio.Event()
        self.upstream: FrameStream | None = None
        self.pump_task: asyncio.Task[None] | None = None
        self.members: list[MemberStream] = []
        self.payer: MemberStream | None = None
        self.log: list[Event] = []  # what was fanned out so far, for late joiners
        self.ended = False
        # "lead" / "follow": registered fleet-wide (coalesce_fleet.py); None: ours only.
        self.fleet: str | None = None

    def joinable(self, req: InferenceRequest, max_buffered: int) -> bool:
        return (
            self.upstream is not None
            and not self.ended
            and bool(self.members)
            and len(self.log) < max_buffered
            and self.deadline >= req.deadline - DEADLINE_SLACK_S
        )

    @property
    def execution_id(self) -> str:
        """The id the worker and engine saw: the leader's, whichever replica it is on."""
        assert self.upstream is not None
        return self.upstream.req.id

    def join(self, req: InferenceRequest) -> MemberStream:
        upstream = self.upstream
        assert upstream is not None
        member = MemberStream(self, upstream, req)
        for event in self.log:
            member.feed(event)
        if not self.members:
            self.payer = member  # the first: the leader, or this replica's first follower
        self.members.append(member)
        return member

    async def charges(self, member: MemberStream) -> bool:
        """Whether ``member``'s record carries the execution's charge: it pays in
        this group, and (fleet-wide) its group is the first to claim the charge."""
        if member is not self.payer:
            return False
        fleet = self.owner.fleet
        if self.fleet is None or fleet is None:
            return True
        return await fleet.pay(self.key, self.execution_id, leads=self.fleet == "lead")

    async def pump(self) -> None:
        upstream = self.upstream
        assert upstream is not None
        hb = self.owner.heartbeat_timeout_s
        try:
            while True:
                try:
                    event = await upstream.next_event(hb, hb / 3)
                except TimeoutError:
                    # Alive but quiet (the worker's heartbeats still come): keep
                    # each member's own liveness check fed. A silent upstream
                    # feeds none, so the members end it (stream_interrupted).
                    if upstream.started and time.monotonic() - upstream.heard_at < hb:
                        self._fan(Heartbeat(upstream.last_seq, time.time(), upstream.attempt or 1))
                    continue
                except GatewayError as exc:
                    event = ErrorFrame(
                        seq=upstream.last_seq,
                        code=exc.code,
                        message=exc.message,
                        status=exc.status,
                        attempt=upstream.attempt or 1,
                    )
                    if self.fleet == "follow":
                        # Our reading failed, not necessarily the execution: its
                        # charge is for the groups that read it to the end.
                        await self._leave_fleet()
                        self.fleet = None
                        self.payer = None
                self.log.append(event)
                self._fan(event)
                if isinstance(event, Final | ErrorFrame):
                    self.ended = True  # before any await: members settle on this now
                    if self.fleet is not None and self.owner.fleet is not None:
                        await self.owner.fleet.end(self.key, self.execution_id)
                    return
        finally:
            self.ended = True
            self.owner._drop(self)
            upstream.close()

    def _fan(self, frame: Token | Final | ErrorFrame | Heartbeat) -> None:
        for member in self.members:
            member.feed(frame)

    async def leave(self, member: MemberStream, reason: str) -> None:
        if self.detach(member):
            await self._stop(reason)

    def close(self, member: MemberStream) -> None:
        if self.detach(member):
            self.owner._own(self._stop("client_disconnected"), "coalesce-stop")

    def detach(self, member: MemberStream) -> bool:
        """Remove a member; True when it was the last and the execution still runs."""
        if member not in self.members:
            return False
        self.members.remove(member)
        if self.ended:
            return False
        if member is self.payer and self.members:
            self.payer = self.members[0]  # the execution goes on: someone else pays
        return not self.members

    async def _stop(self, reason: str) -> None:
        """The last one out stops the engine (and the pump waiting on it); fleet-wide,
        only the last group out does, and a group that leaves others reading pays nothing."""
        self.ended = True
        self.owner._drop(self)
        stop_engine = True
        if self.fleet is not None:
            following = await self._leave_fleet()
            if following != 0:
                stop_engine = False  # others read it (or Redis did not say: err on serving)
                if (following or 0) > 0 or self.fleet == "follow":
                    self.payer = None  # the charge is theirs (opened to them by leave)
        if self.upstream is not None and stop_engine:
            if self.fleet == "follow":
                await self.owner.dispatcher.cancel(self.execution_id, reason)
            else:
                await self.upstream.cancel(reason)
        if self.pump_task is not None:
            self.pump_task.cancel()  # its end closes the upstream (our reading of it)

    async def _leave_fleet(self) -> int | None:
        fleet = self.owner.fleet
        assert fleet is not None
        return await fleet.leave(self.key, self.execution_id, leads=self.fleet == "lead")


class MemberStream(FrameStream):
    """One member's view of a shared execution: its own request (id, deadline,
    tenant) and bounded buffer, fed by the group's pump instead of NATS. The
    pump hands over the upstream's events already ordered and checked; the
    reader keeps the waiting rule and this member's own overflow."""

    silence_message = "The shared execution stopped responding mid-stream."

    def __init__(self, group: _Group, upstream: FrameStream, req: InferenceRequest) -> None:
        owner = group.owner
        # Following another replica's run, the upstream replays its capture at
        # once, faster than any client reads: a bound would end a fast reader as
        # too slow (as a resume's did); unbounded, it is at most a whole answer.
        limit = None if group.fleet == "follow" else owner.max_buffered
        super().__init__(owner.dispatcher, req, FrameBuffer(limit), duplicate=False)
        self.group = group
        self.coalesced_with = "" if req.id == upstream.req.id else upstream.req.id

    async def charged(self) -> bool:
        """Whether this member's ledger record carries the execution's charge."""
        return await self.group.charges(self)

    @property
    def hedged(self) -> bool:
        """Whether the shared execution raced a second copy (its upstream's)."""
        upstream = self.group.upstream
        return upstream is not None and upstream.hedged

    async def hedge_settled(self) -> None:
        upstream = self.group.upstream
        if upstream is not None:
            await upstream.hedge_settled()

    def feed(self, frame: Token | Final | ErrorFrame | Heartbeat) -> None:
        self._queue.offer(frame)  # too slow: this member ends; the others go on

    async def on_first_token(self, attempt: int) -> None:
        # The upstream observed the class's first-token delay and settled any hedge.
        await FrameReader.on_first_token(self, attempt)

    async def recover(self, attempt: int, after: int, through: int) -> list[Token] | None:
        return None  # the pump relays the upstream's tokens in sequence: no gaps

    async def cancel(self, reason: str = "client_disconnected") -> None:
        if not self.done:
            self.done = True
            await self.group.leave(self, reason)

    def close(self) -> None:
        # Never the dispatcher's close: the leader's id is the upstream's too,
        # and its frames must keep flowing to the others.
        self.group.close(self)

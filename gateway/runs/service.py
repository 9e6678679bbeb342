"""Agent runs: the protocol-independent :class:`RunsService`, which HTTP
(``gateway/ingress/runs_http.py``) and NATS (``gateway/ingress/runs_nats.py``)
both serve. The executors (``workers/agent``) do the work; the gateway creates,
shows, decides and cancels runs through the run store, and streams run events
(typed items, ``gateway.runs.views``).

Tenant-scoped: a run of another tenant is a 404, as if it did not exist.

Charging: creating a run holds its whole ``max_cost`` against the tenant's
budgets (one reservation, id = run id, held until the deadline); when the run's
tree has ended the settler (``gateway.runs.settle``) turns the hold into the
actual spend of every run in the tree and writes one ledger record. The
executors never touch budgets: they record usage on the runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from gateway.decoding import decode_body
from gateway.errors import (
    BadRequest,
    BudgetExceeded,
    Conflict,
    GatewayError,
    NotFound,
    PermissionDenied,
    RateLimited,
    Unavailable,
)
from gateway.inference.service import InferenceService
from gateway.runs.bodies import (
    Decision,
    RunCreate,
    check_messages,
    run_budget,
    run_deadline,
)
from gateway.runs.views import Ended, Idle, RunEvent, RunStreamItem
from gateway.tenancy.accounting import Scope
from gateway.tenancy.idempotency import HEADER as IDEM_HEADER
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.records import AGENT_RUN_ROUTE, RecordHead
from gateway.tenancy.tenant_slots import TenantSlots
from gateway.tracing import child_traceparent
from streams.agent import (
    TERMINAL,
    ApprovalDecision,
    Run,
    RunPrice,
    decode_event,
    new_run_id,
    run_id_for,
    token,
)
from streams.agent_store import RunStore
from streams.errors import RunConflictError, RunExistsError, RunStoreError, RunTooLargeError
from streams.ids import is_safe_id
from streams.logs import log_event
from streams.subjects import RequestClass, run_events_subject

# The hold on the tenant's budget outlives the deadline by this much: time for
# the tree to end and the settler to turn the hold into the actual charge.
SETTLE_GRACE_S = 600.0
# Run event streams a tenant may follow at once on one replica (429 past it).
MAX_EVENT_FOLLOWERS = 64
# Compare-and-set rounds to record a decision on a run an executor is also writing.
_RECORD_ATTEMPTS = 5


log = logging.getLogger(__name__)


class RunsService:
    def __init__(self, gw: InferenceService, store: RunStore) -> None:
        self.gw = gw
        self.store = store
        # Each followed event stream is an ordered consumer on the bus and a
        # queue here, free of charge: bounded per tenant, as resumes are.
        self.followers = TenantSlots(
            MAX_EVENT_FOLLOWERS, "run event streams of a tenant open", "too_many_followers"
        )

    async def _key(self, authorization: str | None) -> KeyRecord:
        return await self.gw.tenancy.authenticate(authorization)

    async def _run(self, key: KeyRecord, run_id: str) -> Run:
        stored = None
        if is_safe_id(run_id):
            try:
                stored = await self.store.get(run_id)
            except RunStoreError as exc:
                raise Unavailable("The run store is unavailable.") from exc
        if stored is None or stored.run.tenant != key.tenant:
            raise NotFound(f"No run '{run_id}' for this key's tenant.", code="run_not_found")
        return stored.run

    # -- create ---------------------------------------------------------------------

    async def create(self, raw: bytes, headers: Mapping[str, str]) -> tuple[Run, bool]:
        """The new run, or (``Idempotency-Key`` retry) the run it made first: (run, replayed)."""
        key = await self._key(headers.get("authorization"))
        with self._refusals("create", key, None):
            return await self._create(key, raw, headers)

    @contextlib.contextmanager
    def _refusals(self, action: str, key: KeyRecord, run_id: str | None) -> Iterator[None]:
        """A refusal of an authenticated caller, logged (the ingress answers it):
        over HTTP it was an ``http_error`` line without tenant or run, over NATS
        nothing at all."""
        try:
            yield
        except GatewayError as exc:
            log_event(
                log, "refused", request_id=None, run_id=run_id, tenant=key.tenant, cls="agent",
                action=action, code=exc.code, status=exc.status, gateway=self.gw.cfg.gateway_id,
            )  # fmt: skip
            raise

    async def _create(
        self, key: KeyRecord, raw: bytes, headers: Mapping[str, str]
    ) -> tuple[Run, bool]:
        body = decode_body(raw, RunCreate)
        cfg = self.gw.cfg
        if body.model not in cfg.models:
            raise NotFound(f"The model '{body.model}' does not exist.", param="model")
        tools = tuple(dict.fromkeys(body.tools))
        for name in tools:
            if not is_safe_id(name):
                raise BadRequest(f"Invalid tool name {name!r}.", param="tools")
        key.scopes.check(model=body.model, cls=RequestClass.AGENT.value, tools=tools)
        check_messages(body.messages)
        now = time.time()
        deadline = run_deadline(body, now, cfg.run_default_timeout_s, cfg.run_max_timeout_s)
        price = cfg.prices.for_model(body.model)
        run_price = RunPrice(
            version=cfg.prices.version,
            input_per_1k=price.input_per_1k,
            output_per_1k=price.output_per_1k,
            cached_per_1k=price.cached_per_1k,
        )
        budget = run_budget(body.budget, run_price)
        idem = headers.get(IDEM_HEADER)
        run_id = run_id_for(key.tenant, idem) if idem else new_run_id()
        if idem:
            have = await self._existing(key, run_id)
            if have is not None:
                await self._started(have)
                return have, True
        scope = Scope.of(key)
        run = Run(
            id=run_id,
            tenant=key.tenant,
            org=scope.org,
            key_id=key.key_id,
            key_party=key.party,
            model=body.model,
            deadline=deadline,
            budget=budget,
            price=run_price,
            tools=tools,
            messages=body.messages,
            traceparent=child_traceparent(headers.get("traceparent")),
            created=now,
        )
        try:
            self.store.check_new(run)
        except RunTooLargeError as exc:
            # Before any hold: it was taken, then the store refused the record with a
            # retryable 503, and every retry held the run's max_cost for a day.
            raise _too_large(exc) from None
        try:
            held = await self.gw.accountant.reserve(
                scope,
                run_id,
                budget.max_cost_micros,
                0,
                hold_s=deadline - now + SETTLE_GRACE_S,
                what=self._head(key, body.model, run_id, now).note(),
            )
        except (BudgetExceeded, RateLimited) as exc:
            kind = "budget" if isinstance(exc, BudgetExceeded) else "rate"
            await self._refused(key, body.model, run_id, now, f"rejected:{kind}", exc)
            raise
        if held.settled:  # an Idempotency-Key retry of a run long settled
            have = await self._existing(key, run_id)
            if have is not None:
                return have, True
            raise Conflict("This run id was already settled.", code="duplicate_request")
        try:
            # The step first: a record is never left without one (a crash here
            # leaves a nudge for a run that does not exist, which is dropped).
            # Then the "queued" event, so it is the run's first whatever an
            # executor publishes as soon as the record exists.
            # Indexed under its key first: revoking the key finds it (key_revoked).
            await self.store.index_run(run)
            again = await self.store.nudge(run.id, 0, "start")
            await self.store.publish_status(run)
            stored = await self.store.create(run)
            if again:
                await self._started(stored.run)
        except RunExistsError:
            have = await self._existing(key, run_id)
            if have is None:
                raise Conflict("This run id is taken.", code="duplicate_request") from None
            await self._started(have)
            return have, True
        except RunTooLargeError as exc:
            # Refused whole by the bus (its payload bound below the record's): not
            # stored, so the hold is given back, and no retry can do better.
            await self.gw.accountant.settle(run_id, 0, org=scope.org)
            raise _too_large(exc) from None
        except RunStoreError as exc:
            # The hold stays: the create may have landed unseen (a reply lost in
            # a leader election), and releasing would settle the id, so a retry
            # with the same Idempotency-Key would find it spent (409). A retry
            # finds the run or reserves the same hold again; nobody retrying:
            # the sweep releases it when it expires.
            raise Unavailable("The run store is unavailable.") from exc
        return stored.run, False

    async def _started(self, run: Run) -> None:
        """A retried create found its run still queued: nudge it once more. The
        first attempt's nudge may have reached an executor before the record
        existed and been dropped, and this attempt's own was a duplicate of it
        (``Nats-Msg-Id``), so the run would sit queued. The extra nudge is
        deduplicated too, and a second nudge for a step is harmless."""
        if run.status == "queued" and run.step == 0:
            try:
                await self.store.nudge(run.id, 0, "start", suffix="retried")
            except RunStoreError as exc:
                raise Unavailable("The run store is unavailable.") from exc

    async def _existing(self, key: KeyRecord, run_id: str) -> Run | None:
        try:
            stored = await self.store.get(run_id)
        except RunStoreError as exc:
            raise Unavailable("The run store is unavailable.") from exc
        if stored is None or stored.run.tenant != key.tenant:
            return None
        return stored.run

    def _head(self, key: KeyRecord, model: str, run_id: str, now: float) -> RecordHead:
        return RecordHead(
            scope=Scope.of(key),
            request_id=run_id,
            op="chat",
            cls=RequestClass.AGENT.value,
            model=model,
            created=now,
            price_version=self.gw.cfg.prices.version,
            gateway=self.gw.cfg.gateway_id,
            route=AGENT_RUN_ROUTE,
        )

    async def _refused(
        self, key: KeyRecord, model: str, run_id: str, now: float, policy: str, exc: GatewayError
    ) -> None:
        await self.gw.books.refused(self._head(key, model, run_id, now).refused(policy, exc))

    # -- read, decide, cancel ----------------------------------------------------------

    async def get(self, authorization: str | None, run_id: str) -> Run:
        key = await self._key(authorization)
        with self._refusals("get", key, run_id):
            return await self._run(key, run_id)

    async def decide(
        self, authorization: str | None, run_id: str, call_id: str, raw: bytes
    ) -> dict[str, Any]:
        """Approve or deny the run's pending call: a key with the ``approve``
        scope, and (separation of duties) not the key that created the run
        unless the gateway allows self-approval. The decision, with the deciding
        key, is recorded on the run before the run is nudged."""
        key = await self._key(authorization)
        with self._refusals("decide", key, run_id):
            return await self._decide(key, run_id, call_id, raw)

    async def _decide(
        self, key: KeyRecord, run_id: str, call_id: str, raw: bytes
    ) -> dict[str, Any]:
        body = decode_body(raw, Decision)
        # Before the run is looked up: a key that may not decide learns nothing
        # about which runs exist.
        if not key.scopes.may("approve"):
            raise PermissionDenied(
                "This key may not decide tool calls (it lacks the 'approve' scope).",
                code="approve_scope_required",
            )
        run = await self._run(key, run_id)
        creator = run.key_party or run.key_id
        if key.party == creator and not self.gw.cfg.allow_self_approval:
            raise PermissionDenied(
                "The key that created this run may not decide its gated calls "
                "(separation of duties): ask another key with the 'approve' scope.",
                code="self_approval_forbidden",
            )
        pending = run.pending_approval
        if run.status != "awaiting_approval" or pending is None or pending.call_id != call_id:
            raise Conflict(
                f"Run '{run_id}' is not awaiting approval of call '{call_id}' "
                f"(status: {run.status}).",
                code="no_pending_approval",
            )
        decision = ApprovalDecision(
            call_id=call_id, approve=body.approve, reason=body.reason, at=time.time(),
            key_id=key.key_id, step=run.step,
        )  # fmt: skip
        try:
            kept = await self.store.decide(run.id, run.step, decision)
            if kept.approve != decision.approve:
                raise Conflict(
                    f"Call '{call_id}' was already {'approved' if kept.approve else 'denied'}.",
                    code="already_decided",
                )
            # The decision is durable in the store. Recorded on the run while it
            # is parked (no executor writes it until the nudge below), and
            # re-recorded by a retried POST if a crash came in between; the
            # nudge only makes it prompt (a retried POST re-sends it).
            await self._record_decision(run.id, kept)
            await self.store.nudge(run.id, run.step, "approval", suffix=f"ok-{token(call_id)}")
        except RunStoreError as exc:
            raise Unavailable("The run store is unavailable.") from exc
        return {
            "run_id": run.id,
            "call_id": call_id,
            "approve": kept.approve,
            "accepted": True,
            "decided_by": kept.key_id,
        }

    async def _record_decision(self, run_id: str, decision: ApprovalDecision) -> None:
        """Add ``decision`` to the run's ``approvals`` once (compare-and-set)."""
        for _ in range(_RECORD_ATTEMPTS):
            stored = await self.store.get(run_id)
            if stored is None:
                return
            run = stored.run
            if any(
                a.step == decision.step and a.call_id == decision.call_id for a in run.approvals
            ):
                return
            changed = msgspec.structs.replace(run, approvals=(*run.approvals, decision))
            try:
                await self.store.update(changed, stored.revision)
                return
            except RunConflictError:
                continue  # an executor wrote it meanwhile (a cancel): read it again
        raise Unavailable(
            "The decision is stored but could not be recorded on the run; retry.",
            code="run_busy",
        )

    async def cancel(self, authorization: str | None, run_id: str) -> Run:
        key = await self._key(authorization)
        with self._refusals("cancel", key, run_id):
            return await self._cancel(key, run_id)

    async def _cancel(self, key: KeyRecord, run_id: str) -> Run:
        run = await self._run(key, run_id)
        if run.status in TERMINAL:
            return run
        try:
            await self.store.request_cancel(run.id, "cancelled by the client")
            await self.store.notify_cancel(run.id)  # interrupts its (and descendants') steps now
            await self.store.nudge(run.id, run.step, "cancel", suffix="cancel")
        except RunStoreError as exc:
            raise Unavailable("The run store is unavailable.") from exc
        return run

    async def key_revoked(self, key_id: str) -> int:
        """Stop every run ``key_id`` started (the admin API revoked it); how many
        were still going. The key's recorded cancel stands above each run's tree
        (workers/agent/step.py, ``halting_ids``), so a run created in the moment
        before the revocation reached every replica stops at its first step; the
        notice interrupts steps in flight, and each run found is nudged, so one
        parked on an approval ends now, not at its deadline."""
        try:
            await self.store.request_cancel(key_id, "its API key was revoked")
            going = []
            for run_id in await self.store.runs_of_key(key_id):
                stored = await self.store.get(run_id)
                if stored is not None and not stored.run.terminal:
                    going.append(stored.run)
            await self.store.notify_cancel(key_id)
            for run in going:
                await self.store.nudge(run.id, run.step, "cancel", suffix="cancel")
        except RunStoreError as exc:
            raise Unavailable(
                "The key is revoked, but its runs could not all be stopped: "
                "the run store is unavailable. Revoke it again to retry."
            ) from exc
        return len(going)

    # -- events -----------------------------------------------------------------------

    async def events(self, authorization: str | None, run_id: str, last_event_id: int) -> EventFeed:
        """The run's events after ``last_event_id`` (their stream sequence), then
        live ones, until a terminal status event; :class:`Idle` after each
        ``keepalive_s`` without one. Checked (key, run, subscription) before the
        first item, so a refusal is an error, not an empty stream."""
        key = await self._key(authorization)
        with self._refusals("events", key, run_id):
            run = await self._run(key, run_id)
        subject = run_events_subject(run.tenant, run.id)
        js = self.store.js
        stream = self.store.topo.events_stream
        if run.status in TERMINAL:
            try:
                last = await js.get_last_msg(stream, subject)
            except NotFoundError:
                last = None
            if last is None or (last.seq or 0) <= last_event_id:
                return EventFeed(_ended())
        with self._refusals("events", key, run_id):
            self.followers.enter(run.tenant)  # 429 past the bound, before anything is held
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            queue.put_nowait(msg)

        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        if last_event_id > 0:
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last_event_id + 1
            )
        try:
            sub = await js.subscribe(
                subject, stream=stream, cb=on_msg, ordered_consumer=True, config=config
            )
        except (nats.errors.Error, APIError, TimeoutError) as exc:
            self.followers.leave(run.tenant)
            raise Unavailable("The message bus is unavailable.", code="bus_unavailable") from exc
        except BaseException:
            self.followers.leave(run.tenant)
            raise
        left = functools.partial(self.followers.leave, run.tenant)
        held = _Held(sub, left)
        return EventFeed(_follow(queue, held, self.gw.cfg.keepalive_s), held.release)


class EventFeed:
    """A run's events as :meth:`RunsService.events` hands them over. ``aclose()``
    gives back what following them holds (the tenant's slot, the subscription)
    whether or not they were ever read: an async generator closed before its
    first step runs none of its body, so its ``finally`` never freed them."""

    def __init__(
        self,
        items: AsyncGenerator[RunStreamItem, None],
        release: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._items = items
        self._release = release

    def __aiter__(self) -> EventFeed:
        return self

    async def __anext__(self) -> RunStreamItem:
        return await self._items.__anext__()

    async def aclose(self) -> None:
        try:
            await self._items.aclose()
        finally:
            if self._release is not None:
                await self._release()


class _Held:
    """A follower's slot and subscription, given back once."""

    def __init__(self, sub: Any, left: Callable[[], None]) -> None:
        self._sub = sub
        self._left: Callable[[], None] | None = left

    async def release(self) -> None:
        left, self._left = self._left, None
        if left is None:
            return
        left()
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()


async def _ended() -> AsyncGenerator[RunStreamItem, None]:
    yield Ended()


async def _follow(
    queue: asyncio.Queue[Msg], held: _Held, keepalive_s: float
) -> AsyncGenerator[RunStreamItem, None]:
    try:
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), keepalive_s)
            except TimeoutError:
                yield Idle()
                continue
            try:
                event = decode_event(msg.data)
            except msgspec.DecodeError:
                continue
            seq = msg.metadata.sequence.stream if msg.metadata.sequence else 0
            yield RunEvent(seq, event.kind, msg.data)
            if event.kind == "status" and event.status in TERMINAL:
                return
    finally:
        await held.release()


def _too_large(exc: RunTooLargeError) -> BadRequest:
    return BadRequest(
        f"The run is too large to store: {exc.message}. Send a shorter conversation.",
        code="run_too_large",
        param="messages",
    )

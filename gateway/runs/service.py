"""Agent runs: the API (protocol-independent :class:`RunsService`, and its HTTP
routes). The executors (``workers/agent``) do the work; the gateway creates,
shows, decides and cancels runs through the run store, and streams run events.

    POST /v1/runs                             create (model, messages, tools, budget, deadline)
    GET  /v1/runs/{id}                        the run: status, messages, usage, pending approval
    GET  /v1/runs/{id}/events                 SSE, resumable with Last-Event-ID
    POST /v1/runs/{id}/approvals/{call_id}    {"approve": true|false, "reason": "..."}
    POST /v1/runs/{id}/cancel                 cancel the run and all its descendants

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
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import BadRequest, GatewayError, NotFound, Unavailable
from gateway.inference.service import InferenceService
from gateway.ingress.sse import EventStreamResponse
from gateway.tenancy.accounting import BudgetExceeded, RateLimited, Scope
from gateway.tenancy.idempotency import HEADER as IDEM_HEADER
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.records import RecordHead
from gateway.tenancy.request_ledger import LedgerWriteError
from gateway.tracing import child_traceparent
from gateway.web import json_response
from streams.agent import (
    TERMINAL,
    ApprovalDecision,
    Budget,
    Run,
    RunPrice,
    decode_event,
    new_run_id,
    run_id_for,
    token,
)
from streams.agent_store import RunStore
from streams.errors import RunExistsError, RunStoreError
from streams.subjects import RequestClass, run_events_subject
from streams.wire import Usage

log = logging.getLogger(__name__)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STEPS = 1000
MAX_TOKENS = 10_000_000
# The hold on the tenant's budget outlives the deadline by this much: time for
# the tree to end and the settler to turn the hold into the actual charge.
SETTLE_GRACE_S = 600.0
_encoder = msgspec.json.Encoder()


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class BudgetIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_steps: int | None = None
    max_tokens: int | None = None
    max_cost: float | None = None  # USD
    max_cost_micros: int | None = None  # or integer micro-USD (wins)


class RunCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[dict[str, Any]]
    tools: list[str] = []
    budget: BudgetIn | None = None
    deadline: float | None = None  # absolute unix seconds
    timeout: float | None = None  # or seconds from now


class Decision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    approve: bool
    reason: str = ""


def _decode(raw: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(raw or b"null", type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON: {exc}") from None


def view(run: Run) -> dict[str, Any]:
    """The public shape of a run."""
    spent = run.spent.plus(run.children_spent)
    out: dict[str, Any] = {
        "id": run.id,
        "object": "agent.run",
        "status": run.status,
        "reason": run.reason or None,
        "result": run.result,
        "model": run.model,
        "tools": list(run.tools),
        "parent": run.parent or None,
        "root": run.root_id,
        "depth": run.depth,
        "children": list(run.children),
        "step": run.step,
        "budget": msgspec.to_builtins(run.budget),
        "usage": {
            "steps": spent.steps,
            "prompt_tokens": spent.prompt_tokens,
            "completion_tokens": spent.completion_tokens,
            "total_tokens": spent.tokens,
            "cost_micros": spent.cost_micros,
        },
        "remaining": msgspec.to_builtins(run.remaining()),
        "deadline": run.deadline,
        "created": run.created,
        "updated": run.updated,
        "pending_approval": msgspec.to_builtins(run.pending_approval)
        if run.pending_approval
        else None,
        "ambiguous_key": run.ambiguous_key or None,
        "messages": run.messages,
        "traceparent": run.traceparent,
    }
    return out


class RunsService:
    def __init__(self, gw: InferenceService, store: RunStore) -> None:
        self.gw = gw
        self.store = store

    async def _key(self, authorization: str | None) -> KeyRecord:
        return await self.gw.tenancy.authenticate(authorization)

    async def _run(self, key: KeyRecord, run_id: str) -> Run:
        stored = None
        if _TOOL_NAME.match(run_id):
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
        body: RunCreate = _decode(raw, RunCreate)
        cfg = self.gw.cfg
        if body.model not in cfg.models:
            raise NotFound(f"The model '{body.model}' does not exist.", param="model")
        tools = tuple(dict.fromkeys(body.tools))
        for name in tools:
            if not _TOOL_NAME.match(name):
                raise BadRequest(f"Invalid tool name {name!r}.", param="tools")
        key.scopes.check(model=body.model, cls=RequestClass.AGENT.value, tools=tools)
        _check_messages(body.messages)
        now = time.time()
        deadline = _deadline(body, now, cfg.run_default_timeout_s, cfg.run_max_timeout_s)
        price = cfg.prices.for_model(body.model)
        run_price = RunPrice(
            version=cfg.prices.version,
            input_per_1k=price.input_per_1k,
            output_per_1k=price.output_per_1k,
            cached_per_1k=price.cached_per_1k,
        )
        budget = _budget(body.budget, run_price)
        idem = headers.get(IDEM_HEADER)
        run_id = run_id_for(key.tenant, idem) if idem else new_run_id()
        if idem:
            have = await self._existing(key, run_id)
            if have is not None:
                return have, True
        scope = Scope.of(key)
        try:
            held = await self.gw.accountant.reserve(
                scope, run_id, budget.max_cost_micros, 0, hold_s=deadline - now + SETTLE_GRACE_S
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
        run = Run(
            id=run_id,
            tenant=key.tenant,
            org=scope.org,
            key_id=key.key_id,
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
            # The step first: a record is never left without one (a crash here
            # leaves a nudge for a run that does not exist, which is dropped).
            # Then the "queued" event, so it is the run's first whatever an
            # executor publishes as soon as the record exists.
            await self.store.nudge(run.id, 0, "start")
            await self.store.publish_status(run)
            stored = await self.store.create(run)
        except RunExistsError:
            have = await self._existing(key, run_id)
            if have is None:
                raise Conflict("This run id is taken.", code="duplicate_request") from None
            return have, True
        except RunStoreError as exc:
            with contextlib.suppress(GatewayError):
                await self.gw.accountant.release(run_id)
            raise Unavailable("The run store is unavailable.") from exc
        return stored.run, False

    async def _existing(self, key: KeyRecord, run_id: str) -> Run | None:
        try:
            stored = await self.store.get(run_id)
        except RunStoreError as exc:
            raise Unavailable("The run store is unavailable.") from exc
        if stored is None or stored.run.tenant != key.tenant:
            return None
        return stored.run

    async def _refused(
        self, key: KeyRecord, model: str, run_id: str, now: float, policy: str, exc: GatewayError
    ) -> None:
        head = RecordHead(
            scope=Scope.of(key),
            request_id=run_id,
            op="chat",
            cls=RequestClass.AGENT.value,
            model=model,
            created=now,
            price_version=self.gw.cfg.prices.version,
            gateway=self.gw.cfg.gateway_id,
        )
        record = head.refused(policy, exc)
        try:
            await self.gw.ledger.append(record)
        except LedgerWriteError as exc:
            log.error("ledger append for run %s failed: %s", run_id, exc.message)

    # -- read, decide, cancel ----------------------------------------------------------

    async def get(self, authorization: str | None, run_id: str) -> Run:
        return await self._run(await self._key(authorization), run_id)

    async def decide(
        self, authorization: str | None, run_id: str, call_id: str, raw: bytes
    ) -> dict[str, Any]:
        key = await self._key(authorization)
        body: Decision = _decode(raw, Decision)
        run = await self._run(key, run_id)
        pending = run.pending_approval
        if run.status != "awaiting_approval" or pending is None or pending.call_id != call_id:
            raise Conflict(
                f"Run '{run_id}' is not awaiting approval of call '{call_id}' "
                f"(status: {run.status}).",
                code="no_pending_approval",
            )
        decision = ApprovalDecision(
            call_id=call_id, approve=body.approve, reason=body.reason, at=time.time(),
            key_id=key.key_id,
        )  # fmt: skip
        try:
            kept = await self.store.decide(run.id, run.step, decision)
            if kept.approve != decision.approve:
                raise Conflict(
                    f"Call '{call_id}' was already {'approved' if kept.approve else 'denied'}.",
                    code="already_decided",
                )
            # The decision is durable in the store; the nudge only makes it prompt
            # (a retried POST re-sends it).
            await self.store.nudge(run.id, run.step, "approval", suffix=f"ok-{token(call_id)}")
        except RunStoreError as exc:
            raise Unavailable("The run store is unavailable.") from exc
        return {"run_id": run.id, "call_id": call_id, "approve": kept.approve, "accepted": True}

    async def cancel(self, authorization: str | None, run_id: str) -> Run:
        key = await self._key(authorization)
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

    # -- events -----------------------------------------------------------------------

    async def events(
        self, authorization: str | None, run_id: str, last_event_id: int
    ) -> AsyncIterator[bytes]:
        """SSE bytes: the run's events after ``last_event_id`` (their stream
        sequence), then live ones, until a terminal status event."""
        key = await self._key(authorization)
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
                return _ended()
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
            raise Unavailable("The message bus is unavailable.", code="bus_unavailable") from exc
        return _sse(queue, sub, self.gw.cfg.keepalive_s)


async def _ended() -> AsyncIterator[bytes]:
    yield b": run ended\n\n"


async def _sse(queue: asyncio.Queue[Msg], sub: Any, keepalive_s: float) -> AsyncIterator[bytes]:
    try:
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), keepalive_s)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            try:
                event = decode_event(msg.data)
            except msgspec.DecodeError:
                continue
            seq = msg.metadata.sequence.stream if msg.metadata.sequence else 0
            yield b"id: %d\nevent: %s\ndata: %s\n\n" % (seq, event.kind.encode(), msg.data)
            if event.kind == "status" and event.status in TERMINAL:
                return
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise BadRequest("'messages' must not be empty.", param="messages")
    for i, m in enumerate(messages):
        if m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {sorted(_ROLES)}.")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string, a list or null.")


def _deadline(body: RunCreate, now: float, default_s: float, max_s: float) -> float:
    if body.deadline is not None and body.timeout is not None:
        raise BadRequest("Give 'deadline' or 'timeout', not both.", param="deadline")
    if body.deadline is not None:
        deadline = body.deadline
    else:
        deadline = now + (body.timeout if body.timeout is not None else default_s)
    if not now < deadline <= now + max_s:
        raise BadRequest(
            f"The deadline must be in the future and at most {max_s:g}s away.", param="deadline"
        )
    return deadline


def _budget(asked: BudgetIn | None, price: RunPrice) -> Budget:
    asked = asked or BudgetIn()
    steps = asked.max_steps if asked.max_steps is not None else Budget().max_steps
    tokens = asked.max_tokens if asked.max_tokens is not None else Budget().max_tokens
    if not 1 <= steps <= MAX_STEPS:
        raise BadRequest(f"budget.max_steps must be in [1, {MAX_STEPS}].", param="budget")
    if not 1 <= tokens <= MAX_TOKENS:
        raise BadRequest(f"budget.max_tokens must be in [1, {MAX_TOKENS}].", param="budget")
    if asked.max_cost_micros is not None:
        cost = asked.max_cost_micros
    elif asked.max_cost is not None:
        cost = round(asked.max_cost * 1_000_000)
    else:
        # Default: every token at the output price, the most the tokens can cost.
        cost = price.cost(Usage(prompt_tokens=0, completion_tokens=tokens))
    if cost < 1:
        raise BadRequest("budget.max_cost must be positive.", param="budget")
    return Budget(max_steps=steps, max_tokens=tokens, max_cost_micros=cost)


# -- HTTP ------------------------------------------------------------------------------


def runs_of(request: Request) -> RunsService:
    runs: RunsService | None = request.app.state.runs
    if runs is None:
        raise Unavailable("Agent runs are not enabled on this gateway.")
    return runs


async def create_run(request: Request) -> Response:
    run, replayed = await runs_of(request).create(await request.body(), request.headers)
    headers = {"X-Run-Id": run.id}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return json_response(view(run), 200 if replayed else 201, headers)


async def get_run(request: Request) -> Response:
    run = await runs_of(request).get(
        request.headers.get("authorization"), request.path_params["run_id"]
    )
    return json_response(view(run))


async def decide_call(request: Request) -> Response:
    out = await runs_of(request).decide(
        request.headers.get("authorization"),
        request.path_params["run_id"],
        request.path_params["call_id"],
        await request.body(),
    )
    return json_response(out, 202)


async def cancel_run(request: Request) -> Response:
    run = await runs_of(request).cancel(
        request.headers.get("authorization"), request.path_params["run_id"]
    )
    out = view(run)
    out["cancel_requested"] = run.status not in TERMINAL
    return json_response(out, 202 if out["cancel_requested"] else 200)


async def run_events(request: Request) -> Response:
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    try:
        last = int(raw)
    except ValueError:
        raise BadRequest("Last-Event-ID must be an integer.", param="Last-Event-ID") from None
    body = await runs_of(request).events(
        request.headers.get("authorization"), request.path_params["run_id"], last
    )

    async def nothing(reason: str) -> None:  # the subscription ends with the generator
        return None

    return EventStreamResponse(body, nothing, {"X-Run-Id": request.path_params["run_id"]})


def encode_view(run: Run) -> bytes:
    return _encoder.encode(view(run))

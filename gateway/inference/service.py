"""The protocol-independent request path, shared by the HTTP, WebSocket and
NATS ingresses:

    authenticate -> validate -> authorise (scopes) -> idempotency claim
    -> reserve budget + rate (one Redis script) -> publish -> frames
    -> reconcile -> ledger record

Every accepted request ends in exactly one terminal outcome (:meth:`InferenceService.finish`):
its reservation is reconciled to the actual usage (or released), and one ledger
record is appended (gateway/inference/books.py). Policy refusals (budget, rate,
queue full) get a ledger record too. Never any prompt or completion text.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import msgspec
import nats.errors
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.errors import (
    BadRequest,
    BudgetExceeded,
    ClientLeft,
    GatewayError,
    IdempotencyConflict,
    NotFound,
    RateLimited,
    Timeout,
)
from gateway.inference import rollout
from gateway.inference.books import Books
from gateway.inference.coalesce import Coalescer
from gateway.inference.coalesce_fleet import FleetCoalescing
from gateway.inference.dispatch import Dispatcher, FrameStream, error_from_frame
from gateway.inference.event_ids import tokens_through
from gateway.inference.fair_gate import FairGate
from gateway.inference.kv_routing import KvRouting
from gateway.inference.lanes import LaneRouter
from gateway.inference.openai_types import Parsed, bound_prompt_tokens, parse_body
from gateway.inference.pools import PoolView, adapter_unavailable
from gateway.inference.request_builder import CLASS_HEADER, KINDS, build_request, with_id
from gateway.inference.results import read_result, render
from gateway.inference.route_table import RouteTable
from gateway.inference.sessions import Admitted, Replayed, Resumed, Session
from gateway.inference.settlements import Settlements
from gateway.inference.shadow import Shadows
from gateway.inference.shedding import QueueWatch
from gateway.metrics import GatewayMetrics
from gateway.tenancy.accounting import Accountant, Reservation, Scope
from gateway.tenancy.idempotency import HEADER as IDEM_HEADER
from gateway.tenancy.idempotency import Claim, IdempotencyStore
from gateway.tenancy.keys import KeyRecord, Tenancy
from gateway.tenancy.records import RecordHead
from gateway.tenancy.request_ledger import LedgerWriter
from gateway.tracing import Span, Tracer
from streams.depth import queue_key
from streams.logs import log_event
from streams.tasks import stop_task
from streams.wire import ErrorFrame, Final, InferenceRequest, Meta, Op, Token

# An ingress's check of the authenticated caller against the parsed request.
Gate = Callable[[KeyRecord, Parsed], None]
Caller = Callable[[KeyRecord], None]  # an ingress's check of who called, before the body
_CHANGED = (
    "The request with this Idempotency-Key ended or was released while this retry "
    "waited for it; send it again."
)

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()

# Resumed streams a tenant may hold open at once on one gateway replica.
MAX_RESUMES = 64


class InferenceService:
    def __init__(
        self,
        cfg: GatewayConfig,
        tenancy: Tenancy,
        accountant: Accountant,
        idempotency: IdempotencyStore,
        ledger: LedgerWriter,
        settlements: Settlements,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        routes: RouteTable | None = None,
        queue_watch: QueueWatch | None = None,
        fair_gate: FairGate | None = None,
        fleet_coalescing: FleetCoalescing | None = None,
        pools: PoolView | None = None,
        kv: KvRouting | None = None,
    ) -> None:
        self.cfg = cfg
        self._arms_key = rollout.arms_key(cfg.key_secret)  # the canary split is keyed
        self.tenancy = tenancy
        self.accountant = accountant
        self.idempotency = idempotency
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.routes = routes  # route contracts (None: only cfg.models, no contracts)
        self.queue_watch = queue_watch  # deadline-aware shedding (None: off)
        self.fair_gate = fair_gate  # tenants in turn within a class (None: off)
        self.lanes = LaneRouter(cfg.topology, kv)  # kv: the fleet's KV index (--kv-index)
        self.pools = pools  # deployment pools of routed requests (None: shared subjects)
        self.settlements = settlements
        self.books = Books(cfg, accountant, idempotency, settlements, metrics, routes)
        self.shadows = Shadows(
            cfg, dispatcher, pools, routes, settlements.settle, metrics, accountant
        )
        dispatcher.on_hedge = lambda cls, outcome: metrics.hedges.labels(cls, outcome).inc()
        dispatcher.on_queue_check = lambda result: metrics.queue_checks.labels(result).inc()
        self._background: set[asyncio.Task[None]] = set()  # lingering streams, owned
        self._resuming: dict[str, int] = {}  # tenant -> resumed streams open here
        self.tracer = Tracer(f"jetserve-gateway-{cfg.gateway_id}", cfg.otel_exporter)
        self.coalescer = Coalescer(
            dispatcher,
            cfg.heartbeat_timeout_s,
            cfg.max_buffered_frames,
            metrics.coalesced.inc,
            fleet_coalescing,  # None: each replica coalesces its own requests only
        )

    def models(self) -> list[tuple[str, str | None]]:
        """What /v1/models lists: (model, parent) for each configured or routed
        name a live worker serves, and each LoRA adapter a live worker holds
        (parent: its base model). A name no live worker's engine names is left
        out; while a live worker cannot say what it serves (an older worker, an
        engine without /v1/models), every configured name stays in."""
        routed = self.routes.names() if self.routes is not None else []
        names = list(dict.fromkeys([*self.cfg.models, *routed, *self.cfg.embedding_models]))
        if self.pools is None:
            return [(m, None) for m in names]
        served = self.pools.served_models()
        listed: list[tuple[str, str | None]] = [
            (m, None) for m in names if served is None or self._served(m, served)
        ]
        known = set(names)
        adapters = self.pools.adapters()
        listed += [(a, adapters[a] or None) for a in sorted(adapters) if a not in known]
        return listed

    def _served(self, model: str, served: set[str]) -> bool:
        record = self.routes.get(model) if self.routes is not None else None
        if record is None:
            return model in served
        # A route is served when a candidate's pool has a live worker.
        return any(self.pools is not None and self.pools.live(d.name)
                   for d in record.contract.candidates)  # fmt: skip

    # -- admission ---------------------------------------------------------------
    async def admit(
        self,
        op: Op,
        raw: bytes,
        headers: Mapping[str, str],
        gate: Gate | None = None,
        gone: asyncio.Event | None = None,
        caller: Caller | None = None,
    ) -> Admitted | Replayed:
        """Authenticate, parse, reserve and enqueue. ``caller`` (an ingress's
        check of the authenticated caller, e.g. that its reply goes to its own
        tenant) runs right after authentication, before the body is read;
        ``gate`` (its check of the caller against the request) after parsing,
        and both before anything is charged or queued. ``gone``: set by the
        ingress when the client hangs up; while the request is being queued
        that cancels it by id at once (gateway/inference/dispatch.py)."""
        key: KeyRecord | None = None
        parsed: Parsed | None = None
        try:
            key = await self.tenancy.authenticate(headers.get("authorization"))
            if caller is not None:
                caller(key)
            parsed, body = parse_body(raw, KINDS[op])
            if gate is not None:
                gate(key, parsed)
            idem = headers.get(IDEM_HEADER)
            req = build_request(
                self.cfg, self.routes, self.dispatcher.reply_for, op, parsed, body, key, headers,
                self.pools.adapters if self.pools is not None else dict,
            )  # fmt: skip
            if req.adapter and (
                self.pools is None or not self.pools.holders(req.adapter, req.candidates)
            ):
                # Refused before any hold: a route lists it, but no live worker
                # of its candidates holds it now.
                raise adapter_unavailable(req.adapter)
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            # Before a request id exists: what is known of the caller, for every
            # ingress (HTTP, WebSocket, NATS), never the body.
            log_event(
                log, "refused", request_id=None, tenant=key.tenant if key else None,
                cls=headers.get(CLASS_HEADER, "embed" if op == "embedding" else "interactive"),
                model=parsed.model if parsed else None, code=exc.code, status=exc.status,
                gateway=self.cfg.gateway_id,
            )  # fmt: skip
            raise
        span = self.tracer.start(
            "jetserve.request",
            headers.get("traceparent"),
            {
                "gen_ai.operation.name": op,
                "gen_ai.request.model": req.model,
                "jetserve.class": req.cls,
            },
        )
        req = msgspec.structs.replace(req, traceparent=span.traceparent)
        claim = None
        try:
            if idem is not None:
                claim = await self.idempotency.claim(key.tenant, idem, raw, req.deadline)
                if claim.replay is not None:
                    assert claim.replay.response is not None
                    span.end("replayed")
                    return Replayed(claim.replay.status, claim.replay.response, claim.request_id)
                req = with_id(
                    req, claim.request_id, self.dispatcher.reply_for(key.tenant, claim.request_id)
                )
                if claim.attach:
                    attached = await self._attach(op, parsed, key, req, raw, claim, gone)
                    if attached is not None:
                        span.end("attached")
                        return attached
                    # Nothing queued by the first run (its gateway died first): run it
                    # here, under the same request id, as the claim's owner now.
                    owned = await self.idempotency.take_over(claim)
                    if owned is None:
                        raise IdempotencyConflict(_CHANGED)
                    claim = owned
            span.set("jetserve.request_id", req.id)
            req = self._split(req)
            if claim is None or not claim.owner:
                return await self._reserve_and_submit(op, parsed, key, req, raw, claim, span, gone)
            async with self._admitting(claim):
                return await self._reserve_and_submit(op, parsed, key, req, raw, claim, span, gone)
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            # Every refusal once a request id exists (the hold's, the queue's, the
            # Idempotency-Key's: a key reused, still running, its store down).
            self._log_refusal(req, exc)
            span.end(exc.code)
            if claim is not None:
                await self.books.idem_fail(claim, raw, exc)
            raise

    @contextlib.asynccontextmanager
    async def _admitting(self, claim: Claim) -> AsyncIterator[None]:
        """While its run is admitted, the claim's owner says it is alive, so a
        retry follows it instead of taking it over (idempotency.alive)."""
        every = self.cfg.idempotency_takeover_s / 3

        async def keep() -> None:
            while True:
                with contextlib.suppress(RedisError, OSError):
                    await self.idempotency.admitting(claim, self.cfg.idempotency_takeover_s)
                await asyncio.sleep(every)

        task = asyncio.create_task(keep())
        try:
            yield
        finally:
            await stop_task(task)

    async def _attach(
        self,
        op: Op,
        parsed: Parsed,
        key: KeyRecord,
        req: InferenceRequest,
        raw: bytes,
        claim: Claim,
        gone: asyncio.Event | None = None,
    ) -> Admitted | None:
        """A retry of a run in flight or streamed: follow its frames from the
        start (any replica's, its gateway alive or not). None: the first run
        queued nothing within ``takeover_s`` of its claim, so this one runs it.
        It waits at most to its own deadline, and not for a client that left."""
        wait = 0.05  # the first run is between its claim and its queueing
        while True:
            stream = await self._replay(key.tenant, claim.request_id, 0)
            if stream is not None:
                break
            # Nothing queued yet: taken over only once its owner has stopped saying
            # it is still admitting it (a hold, a fair gate's wait can be long).
            if time.time() >= claim.created + self.cfg.idempotency_takeover_s and not (
                await self.idempotency.alive(claim)
            ):
                return None
            if time.time() >= req.deadline:
                raise Timeout("A request with this Idempotency-Key is still being admitted.")
            if gone is not None and gone.is_set():
                raise ClientLeft("The client left while its retry waited for the first run.")
            await asyncio.sleep(wait)
            wait = min(wait * 2, 1.0)
        assert stream.meta is not None
        reservation = Reservation(
            request_id=claim.request_id,
            scope=Scope.of(key),
            cost_micros=stream.meta.reserved_micros,
            tokens=0,
            created_at=stream.meta.created,
            expires_at=stream.meta.deadline,
            replayed=True,
        )
        self.metrics.inflight.inc()
        self.metrics.idempotent_attached.inc()
        return Admitted(op, parsed, key, stream, reservation, raw, claim, attached=True)

    async def _reserve_and_submit(
        self,
        op: Op,
        parsed: Parsed,
        key: KeyRecord,
        req: InferenceRequest,
        raw: bytes,
        claim: Claim | None,
        span: Span,
        gone: asyncio.Event | None = None,
    ) -> Admitted:
        price = self.cfg.prices.for_model(req.model)
        worst = price.worst_case(bound_prompt_tokens(parsed), req.max_tokens)
        scope = Scope.of(key)
        try:
            # The hold outlives the request by a grace; past it, the orphan sweep
            # settles it from the frames capture (gateway/inference/settlements.py).
            reservation = await self.accountant.reserve(
                scope,
                req.id,
                worst,
                req.prompt_tokens_est + req.max_tokens,
                hold_s=max(1.0, req.deadline - time.time()) + self.cfg.settle_grace_s,
                # Should this gateway die before queueing it, the sweep records it.
                what=RecordHead.of_request(
                    req, scope, self.cfg.prices.version, self.cfg.gateway_id
                ).note(),
            )
        except (BudgetExceeded, RateLimited) as exc:
            kind = "budget" if isinstance(exc, BudgetExceeded) else "rate"
            # Under an Idempotency-Key the request id is the key's, given back
            # when the refused claim is forgotten (books.idem_fail): the record
            # takes an id of its own, or the retry's, under the same id, would be
            # dropped as its duplicate (the ledger's and the outbox's dedupe).
            refused = req if claim is None else msgspec.structs.replace(req, id=uuid.uuid4().hex)
            await self.books.refused(self.books.refusal(refused, key, f"rejected:{kind}", exc))
            raise
        if reservation.settled:
            if claim is not None:
                # A run taken over whose first owner's hold was settled meanwhile
                # (the orphan sweep recorded it): this id is spent; the key's next
                # try runs under a new one (retryable: the claim is released).
                raise IdempotencyConflict(_CHANGED)
            raise BadRequest("This request id was already served.", code="duplicate_request")
        if reservation.replayed and claim is not None:
            # A taken-over run holds its first owner's hold: it ends before that
            # hold's expiry, so the orphan sweep never settles it while it runs.
            latest = reservation.expires_at - self.cfg.settle_grace_s
            if req.deadline > latest:
                req = msgspec.structs.replace(req, deadline=max(time.time(), latest))
        span.event("held")
        meta = self._meta(req, scope, reservation.cost_micros)
        try:
            # The queue it goes to: the class's shared one, or a candidate's pool,
            # judged by that queue's own depth (a pool's backlog, which only its
            # own workers take, holds back no one else).
            pool = await self._pool_of(req)
            queue = queue_key(req.cls, pool)
            self._shed(req, queue)
            excess = False
            if self.fair_gate is not None:
                # The tenant's turn (at once unless the queue is long); counted
                # as published to the queue watch when it comes.
                excess = await self.fair_gate.enter(
                    queue, req.tenant, req.deadline, reservation.weight, self._service_s(req),
                    gone,
                )  # fmt: skip
            elif self.queue_watch is not None and self.cfg.shed:
                # Counted as queued until the next look at the queue (a coalesced
                # follower too: a slight overestimate, on the safe side).
                self.queue_watch.published(queue)
            stream = await self._submit(req, meta, claim is not None, excess, gone, pool)
            span.event("queued")
        except GatewayError as exc:
            refusal = self.books.refusal(req, key, f"rejected:{exc.code}", exc)
            await self.books.append(refusal, release=True)
            raise
        self._shadow(req, stream)
        self.metrics.inflight.inc()
        return Admitted(op, parsed, key, stream, reservation, raw, claim, span)

    def _split(self, req: InferenceRequest) -> InferenceRequest:
        """The request's rollout arm, by its final id (an idempotency key's id
        included), under the revision it was built with (gateway/inference/rollout.py)."""
        record = (
            self.routes.at(req.route, req.route_revision)
            if self.routes is not None and req.route
            else None
        )
        policy = record.contract.rollout if record is not None else None
        if record is None or policy is None or policy.canary is None:
            return req
        which = rollout.arm(policy.canary, req.route, req.id, req.cls, req.tenant, self._arms_key)
        if not which:
            return req  # outside the canary's scope: the candidates already omit it
        return msgspec.structs.replace(
            req, candidates=rollout.candidates(record.contract, which), rollout_arm=which
        )

    def _shadow(self, req: InferenceRequest, stream: FrameStream) -> None:
        """A copy for the rollout's shadow candidate (gateway/inference/shadow.py),
        of a request queued for real: not a duplicate, not a coalesced follower."""
        if self.routes is None or not req.route:
            return
        if type(stream) is not FrameStream or stream.duplicate:
            return
        record = self.routes.at(req.route, req.route_revision)
        if record is None or record.contract.rollout is None:
            return
        if self.shadows.maybe(req, record.contract):
            stream.kept = []  # the served text, for the copy's comparison

    def _log_refusal(self, req: InferenceRequest, exc: GatewayError) -> None:
        log_event(
            log, "refused", request_id=req.id, tenant=req.tenant, cls=req.cls,
            model=req.model, code=exc.code, status=exc.status, gateway=self.cfg.gateway_id,
        )  # fmt: skip

    def _meta(self, req: InferenceRequest, scope: Scope, reserved_micros: int) -> Meta:
        """The stream's head frame: what a resume on any replica needs to keep the books."""
        return Meta(
            op=req.op,
            model=req.model,
            cls=req.cls,
            tenant=req.tenant,
            deadline=req.deadline,
            created=req.created,
            key_id=req.key_id,
            org=scope.org,
            reserved_micros=reserved_micros,
            price_version=self.cfg.prices.version,
            gateway=self.cfg.gateway_id,
            prompt_tokens_est=req.prompt_tokens_est,
        )

    async def _submit(
        self,
        req: InferenceRequest,
        meta: Meta,
        idempotent: bool,
        excess: bool = False,
        gone: asyncio.Event | None = None,
        pool: str = "",
    ) -> FrameStream:
        """Publish under the route's policies (lane, hedging), or follow an
        identical request in flight (coalescing; never on the idempotency path).
        ``excess``: a tenant's request past its turn, to the class's excess
        subject, never hedged (its delay is its tenant's own queue). ``pool``:
        the token of the candidate's pool it goes to (:meth:`_pool_of`)."""
        # The revision the request was built under (a change may land meanwhile).
        record = (
            self.routes.at(req.route, req.route_revision)
            if self.routes is not None and req.route
            else None
        )
        contract = record.contract if record is not None else None
        hedge = contract.hedge if contract is not None else self.cfg.hedge
        routing = contract.routing if contract is not None else self.cfg.routing
        shared = contract.coalesce.cross_tenant if contract is not None else False
        coalesce = contract.coalesce if contract is not None else self.cfg.coalesce

        async def publish(grouped: bool) -> FrameStream:
            subject, keys = self.lanes.route(
                req.op, req.cls, req.tenant, req.body, routing, shared, excess, pool, req.adapter
            )
            # The engine's prefix cache is the tenant's own unless the route marks
            # prefixes shared: lanes alone kept a tenant's prefixes apart only in
            # where they ran, and another tenant's request on the same engine was
            # told (cached_tokens, its first token's delay) what it had sent.
            sent = msgspec.structs.replace(
                req, prefix_keys=keys or req.prefix_keys, cache_scope="" if shared else req.tenant
            )
            # A group's request (others may join while it is queued) is not its
            # client's alone to cancel: the group ends it when its last member leaves.
            return await self.dispatcher.submit(
                sent,
                meta,
                subject,
                hedge if hedge.enabled and not excess else None,
                None if grouped else gone,
            )

        # A canary-arm request never shares an execution: a follower would be
        # served by another arm's deployment, a leader would lend it the canary's.
        solo = idempotent or req.rollout_arm == "canary"
        return await self.coalescer.submit(req, None if solo else coalesce, publish)

    async def _pool_of(self, req: InferenceRequest) -> str:
        """The token of the pool a routed request goes to ("" for the class's shared
        subjects): its first candidate with a live worker, whose workers alone pull
        it; for a LoRA adapter, the first whose worker holds it."""
        if self.pools is None:
            return ""
        if req.adapter:
            chosen = self.pools.choose_adapter(req.adapter, req.candidates)
            return await self.pools.token(chosen)
        if req.candidates:
            return await self.pools.token(self.pools.choose(req.candidates))
        return ""

    def _service_s(self, req: InferenceRequest) -> float:
        """What an answer of this class takes once it started: its median first-token
        delay and answer time (what the fair gate adds to a request's wait)."""
        first_token_s, _ = self.dispatcher.hedger.quantile(req.cls, 0.5)
        if self.queue_watch is None:
            return first_token_s
        watch = self.queue_watch
        return watch.first_token_time(req.cls, first_token_s) + watch.answer_time(req.cls)

    def _shed(self, req: InferenceRequest, queue: str) -> None:
        """Refuse early what the queue ahead would keep past its deadline."""
        if self.queue_watch is None or not self.cfg.shed:
            return
        first_token_s, _ = self.dispatcher.hedger.quantile(req.cls, 0.5)
        seconds_left = req.deadline - time.time()
        retry_after = self.queue_watch.verdict(req.cls, seconds_left, first_token_s, queue)
        if retry_after is not None:
            log_event(
                log, "shed", request_id=req.id, tenant=req.tenant, cls=req.cls,
                seconds_left=round(seconds_left, 3), retry_after=round(retry_after, 3),
                **self.queue_watch.inputs(req.cls, first_token_s, queue),
            )  # fmt: skip
            raise RateLimited(
                "The queue ahead of this request would outlast its deadline; retry later.",
                code="deadline_unmeetable",
                retry_after=retry_after,
            )

    # -- the terminal outcome --------------------------------------------------------
    async def finish(
        self,
        adm: Session,
        outcome: str,
        status: int,
        final: Final | None = None,
        then: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """The one terminal outcome of a request on this gateway (idempotent):
        metrics and span, then the books (gateway/inference/books.py), then
        ``then`` (the idempotency key's part). Once decided, it is recorded
        whatever becomes of the caller: a client that leaves while the books are
        written cancels its response, not them (shielded, and owned here)."""
        books = self.decide(adm, outcome, status, final, then)
        if books is not None:
            await asyncio.shield(books)

    def decide(
        self,
        adm: Session,
        outcome: str,
        status: int,
        final: Final | None = None,
        then: Callable[[], Awaitable[None]] | None = None,
    ) -> asyncio.Future[None] | None:
        """Set the request's outcome now and start recording it (see
        :meth:`finish`); the recording, to await shielded, or None when the
        outcome was decided before. A stream decides at its final frame, before
        its client sees the end: a client that leaves then leaves an answered
        request, not a cancelled one."""
        if adm.outcome is not None:
            return None
        adm.outcome = outcome
        adm.stream.close()
        books = asyncio.ensure_future(self._record(adm, outcome, status, final, then))
        self._background.add(books)
        books.add_done_callback(self._background.discard)
        return books

    async def _record(
        self,
        adm: Session,
        outcome: str,
        status: int,
        final: Final | None,
        then: Callable[[], Awaitable[None]] | None,
    ) -> None:
        await self._record_books(adm, outcome, status, final)
        if then is not None:
            await then()

    async def _record_books(
        self, adm: Session, outcome: str, status: int, final: Final | None
    ) -> None:
        await adm.stream.hedge_settled()
        span = adm.span if isinstance(adm, Admitted) else None
        if span is not None and final is not None:
            span.set("gen_ai.usage.input_tokens", final.usage.prompt_tokens)
            span.set("gen_ai.usage.output_tokens", final.usage.completion_tokens)
            span.set("jetserve.attempts", final.attempt)
            span.event("final")
        try:
            await self._conclude(adm, outcome, status, final)
        finally:
            if span is not None:  # after the books: an answer waits for its settlement's store
                span.end(final.finish_reason if final else outcome)

    async def _conclude(self, adm: Session, outcome: str, status: int, final: Final | None) -> None:
        """Metrics and the log line, then the books."""
        e2e = time.monotonic() - adm.started
        if final is None:  # an accepted request that did not complete: say which, and why
            req = adm.stream.req
            log_event(
                log, "ended", request_id=req.id, tenant=req.tenant, cls=req.cls,
                outcome=outcome, status=status, ms=round(e2e * 1000),
                gateway=self.cfg.gateway_id,
            )  # fmt: skip
        first_ms = self._observe(adm, "ok" if final else outcome, final, e2e, status)
        kept = adm.stream.kept
        if kept is not None and isinstance(adm, Admitted):
            self.shadows.served(adm.request_id, "".join(kept) if final is not None else None)
        await self.books.settle(adm, outcome, status, final, e2e, first_ms)
        if isinstance(adm, Admitted) and adm.wants_stream and final is not None:
            await self.books.stream_done(adm)

    def _observe(
        self, adm: Session, label: str, final: Final | None, e2e: float, status: int
    ) -> float | None:
        """Count the outcome; the first-token delay in ms, when it had one."""
        m = self.metrics
        req = adm.stream.req
        first_ms = None
        if isinstance(adm, Admitted):
            m.inflight.dec()
            m.requests.labels(adm.op, req.cls, label).inc()
            m.tenant_requests.labels(m.tenant_label(req.tenant), label).inc()
            m.e2e.labels(adm.op, req.cls).observe(e2e)
            if adm.stream.first_token_at is not None:
                ttft = adm.stream.first_token_at - adm.started
                m.ttft.labels(req.cls).observe(ttft)
                first_ms = ttft * 1000
                if final is not None and final.usage.completion_tokens > 1:
                    tpot = (e2e - ttft) / (final.usage.completion_tokens - 1)
                    m.tpot.labels(req.cls).observe(tpot)
                if final is not None and self.queue_watch is not None:
                    self.queue_watch.answered(req.cls, e2e - ttft)
                    # An answer without tokens (embeddings): its first is its last.
                    started_ms = final.ttft_ms or final.engine_ms
                    if started_ms > 0:
                        self.queue_watch.started_to_first_token(req.cls, started_ms / 1000)
        else:
            m.requests.labels(adm.op, req.cls, f"resumed_{label}").inc()
        if req.rollout_arm and isinstance(adm, Admitted):
            result = "ok" if final is not None else "error" if status >= 500 else "other"
            m.rollout_requests.labels(req.route, req.rollout_arm, result).inc()
            if first_ms is not None:
                m.rollout_ttft.labels(req.route, req.rollout_arm).observe(first_ms / 1000)
        if final is not None:
            m.tokens.labels(req.cls, "input").inc(final.usage.prompt_tokens)
            m.tokens.labels(req.cls, "output").inc(final.usage.completion_tokens)
        return first_ms

    async def fail(self, adm: Session, exc: GatewayError) -> None:
        then = None
        if isinstance(adm, Admitted) and adm.claim is not None:
            # A retry attached to a run that went silent without an error frame
            # (its worker died mid-stream): once the run's deadline has passed the
            # run is over, and the key is released for the next try.
            over = adm.attached and time.time() >= adm.stream.req.deadline
            then = functools.partial(self.books.idem_fail, adm.claim, adm.raw, exc, over)
        if _follows(adm) and not exc.from_run and adm.outcome is None:
            # A reader that only follows the run (a resume, an attached retry) failed
            # on its own (its link, its pace, its deadline), not the run: the books
            # are the run's owner's (or, its gateway gone, the orphan sweep's, from
            # the capture). Settled here, its partial view (11 of 1,200 tokens) was
            # the run's one record and charge, and the owner's full one was refused.
            self._detach(adm)
            if then is not None:
                await then()
            return
        await self.finish(adm, exc.code, exc.status, then=then)

    def _detach(self, adm: Session) -> None:
        """Stop following a run whose books are not this session's."""
        adm.outcome = "detached"
        adm.stream.close()
        if isinstance(adm, Admitted):
            self.metrics.inflight.dec()

    async def abandon(
        self,
        adm: Session,
        reason: str = "client_disconnected",
        *,
        may_resume: bool = True,
        status: int = 499,
    ) -> None:
        """The client went away. Without a resume grace, cancel upstream so the
        engine stops at once; with one, give the client that long to resume
        (``may_resume`` False: it left before its response began, so it never
        learnt the request id a resume needs). ``status``: what the record says
        the client saw (499, or the error it was sent).
        Nothing to do once the request has its outcome (a client that leaves as
        its answer is being recorded)."""
        if adm.outcome is not None:
            self.metrics.client_left.labels("at_end").inc()
            return
        self.metrics.client_left.labels("in_flight").inc()
        grace = self.cfg.resume_grace_s
        lingering = may_resume and reason == "client_disconnected" and grace > 0
        if (
            isinstance(adm, Admitted)
            and adm.wants_stream
            and lingering
            and not adm.attached
            and not adm.stream.done
        ):
            if not adm.lingering:  # once: a second hang-up report changes nothing
                adm.lingering = True
                task = asyncio.ensure_future(self._linger(adm, reason, grace))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            return
        if isinstance(adm, Resumed) or adm.attached:  # _follows, narrowed
            # A resumed client left: the original gateway (or the one that took
            # the books) decides about the upstream; we only stop following.
            self._detach(adm)
            return
        await self._cancel(adm, reason, status)

    async def _cancel(self, adm: Admitted, reason: str, status: int = 499) -> None:
        """Stop the upstream and record the request cancelled; a retry of its
        Idempotency-Key runs again."""
        await adm.stream.cancel(reason)
        claim = adm.claim
        then = None if claim is None else functools.partial(self.books.idem_release, claim)
        outcome = "cancelled" if reason.startswith("client_d") else reason
        await self.finish(adm, outcome, status, then=then)

    async def _linger(self, adm: Admitted, reason: str, grace: float) -> None:
        """A streaming client left: for ``grace``, a resume (on any replica) may
        pick the stream up; then, or if none came, the stream is cancelled. The
        books follow the stream meanwhile (its frames read here, so a long one
        does not fill its buffer and end as too slow), and to its end once a
        resume came."""
        try:
            resumed = await self.dispatcher.watch_resumed(adm.request_id)
        except nats.errors.Error:
            await self._cancel(adm, reason)  # no way to hear of a resume
            return
        until = time.monotonic() + grace
        try:
            while True:
                left = None if resumed.is_set() else until - time.monotonic()
                if left is not None and left <= 0:
                    await self._cancel(adm, reason)
                    return
                try:
                    event = await adm.stream.next_event(self.cfg.heartbeat_timeout_s, left)
                except TimeoutError:
                    continue  # the grace is up, or a resume came meanwhile: look again
                except GatewayError as exc:
                    await self.fail(adm, exc)
                    return
                if isinstance(event, Token):
                    adm.tokens_seen += 1 + len(adm.stream.drain_tokens())
                elif isinstance(event, ErrorFrame):
                    await self.fail(adm, error_from_frame(event))
                    return
                else:
                    await self.finish(adm, "ok", 200, event)
                    return
        finally:
            await self.dispatcher.unwatch_resumed(adm.request_id)

    async def resume(
        self, authorization: str | None, request_id: str, last_event_id: int, include_usage: bool
    ) -> Resumed:
        """The stream after the client's ``Last-Event-ID`` (gateway/inference/event_ids.py)."""
        key = await self.tenancy.authenticate(authorization)
        stream = await self._replay(key.tenant, request_id, tokens_through(last_event_id))
        if stream is None:
            raise NotFound(
                f"No resumable stream '{request_id}' for this key's tenant.",
                code="stream_not_found",
            )
        return Resumed(stream, include_usage, last_event_id)

    async def _replay(self, tenant: str, request_id: str, through: int) -> FrameStream | None:
        """The capture of ``request_id`` after token ``through``, then live: a
        resume, or an Idempotency-Key retry following its first run. Bounded per
        tenant: a replay holds what it replays (up to a whole answer) for as long
        as its client takes to read it, at no charge, and those that never read
        grew the gateway by ~1 MB each."""
        if self._resuming.get(tenant, 0) >= MAX_RESUMES:
            raise RateLimited(
                f"At most {MAX_RESUMES} resumed or followed streams of a tenant at once "
                "on this gateway; finish one first.",
                code="too_many_resumes",
                retry_after=1.0,
            )
        self._resuming[tenant] = self._resuming.get(tenant, 0) + 1
        try:
            stream = await self.dispatcher.resume(tenant, request_id, through)
        except BaseException:
            self._resumed_end(tenant)
            raise
        if stream is None:
            self._resumed_end(tenant)
            return None
        stream.on_close = functools.partial(self._resumed_end, tenant)
        return stream

    def _resumed_end(self, tenant: str) -> None:
        left = self._resuming.get(tenant, 0) - 1
        if left > 0:
            self._resuming[tenant] = left
        else:
            self._resuming.pop(tenant, None)

    async def aclose(self) -> None:
        """Wait for lingering disconnected streams (bounded by their grace)."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.cfg.resume_grace_s + 5)
        await self.coalescer.aclose()
        await self.shadows.aclose()
        await self.books.summarise(all_now=True)  # the refusals counted so far
        await self.settlements.aclose()
        self.tracer.shutdown()  # flush exported spans

    # -- results -----------------------------------------------------------------
    async def answer(self, adm: Admitted, limit: int | None = None) -> dict[str, Any]:
        """Wait for the whole result (non-streaming clients): the response body,
        its outcome recorded.
        ``limit``: the most the caller's transport carries (a NATS reply); a body
        over it ends the request 400 ``response_too_large``, recorded so, and
        charged as a failed request is (what was evidently produced): it was
        recorded ``ok`` and charged in full while its caller got the 400."""
        try:
            result = await read_result(adm, self.cfg.heartbeat_timeout_s)
            body = render(adm, result)
            if limit is not None and (size := len(_json.encode(body))) > limit:
                raise BadRequest(
                    f"The answer is {size} bytes, over the message bus's limit of {limit}: "
                    "send fewer inputs, or ask for base64.",
                    code="response_too_large",
                )
            # The Idempotency-Key's answer is stored with the books, in their owned
            # and shielded task: a caller cancelled meanwhile (a WebSocket's cancel
            # frame) cut the store, and left the key's claim neither done nor released.
            await self.finish(
                adm, "ok", 200, result.final, then=functools.partial(self.books.complete, adm, body)
            )
        except GatewayError as exc:
            await self.fail(adm, exc)
            raise
        return body


def _follows(adm: Session) -> bool:
    """Whether the session only follows a run another session owns the books of:
    a resumed stream, or a retry attached to its Idempotency-Key's run."""
    return isinstance(adm, Resumed) or adm.attached

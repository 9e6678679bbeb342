"""The protocol-independent request path, shared by the HTTP, WebSocket and
NATS ingresses:

    authenticate -> validate -> authorise (scopes) -> idempotency claim
    -> reserve budget + rate (one Redis script) -> publish -> frames
    -> reconcile -> ledger record

Every accepted request ends in exactly one terminal outcome (:meth:`InferenceService.finish`):
its reservation is reconciled to the actual usage (or released), and one ledger
record is appended. Policy refusals (budget, rate, queue full) get a ledger
record too. Never any prompt or completion text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.config import GatewayConfig
from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.errors import RateLimited as QueueRateLimited
from gateway.inference.coalesce import Coalescer, MemberStream
from gateway.inference.dispatch import Dispatcher, FrameStream, error_from_frame
from gateway.inference.lanes import LaneRouter
from gateway.inference.openai_types import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Parsed,
    ParsedType,
    bound_prompt_tokens,
    completion_response,
    embeddings_response,
    estimate_prompt_tokens,
    merge_tool_calls,
    parse_body,
)
from gateway.inference.route_table import RouteTable
from gateway.inference.shedding import QueueWatch
from gateway.metrics import GatewayMetrics
from gateway.tenancy.accounting import Accountant, BudgetExceeded, RateLimited, Reservation, Scope
from gateway.tenancy.idempotency import HEADER as IDEM_HEADER
from gateway.tenancy.idempotency import Claim, IdempotencyStore
from gateway.tenancy.keys import KeyRecord, Tenancy
from gateway.tenancy.records import RecordHead, Serving
from gateway.tenancy.request_ledger import LedgerWriteError, LedgerWriter
from gateway.tracing import Span, Tracer
from streams.request_ledger import LedgerRecord
from streams.routes import RouteRecord
from streams.subjects import RequestClass
from streams.wire import (
    HEDGE_ATTEMPT_BASE,
    ErrorFrame,
    Final,
    InferenceRequest,
    Meta,
    Op,
    Token,
    Usage,
)

log = logging.getLogger(__name__)

_KINDS: dict[Op, ParsedType] = {
    "chat": ChatRequest,
    "completion": CompletionRequest,
    "embedding": EmbeddingRequest,
}
CLASS_HEADER = "x-jetserve-class"
TIMEOUT_HEADER = "x-jetserve-timeout"
DATA_CLASS_HEADER = "x-jetserve-data-class"  # what the request carries (e.g. pii); authorised


@dataclass
class Admitted:
    """An accepted request: from here on it must end in one recorded outcome."""

    op: Op
    parsed: Parsed
    key: KeyRecord
    stream: FrameStream
    reservation: Reservation
    raw: bytes
    claim: Claim | None = None
    span: Span | None = None
    started: float = field(default_factory=time.monotonic)
    outcome: str | None = None
    tokens_seen: int = 0  # token frames relayed, for a charge when no usage arrives

    @property
    def request_id(self) -> str:
        return self.stream.req.id

    @property
    def wants_stream(self) -> bool:
        return bool(getattr(self.parsed, "stream", False))

    @property
    def include_usage(self) -> bool:
        opts = getattr(self.parsed, "stream_options", None)
        return bool(opts and opts.include_usage)

    @property
    def model(self) -> str:
        return self.parsed.model

    @property
    def scope(self) -> Scope:
        return Scope.of(self.key)

    @property
    def reserved_micros(self) -> int:
        return self.reservation.cost_micros


@dataclass
class Resumed:
    """A client picking up a stream from the frames capture, on any replica."""

    stream: FrameStream
    include_usage: bool = False
    started: float = field(default_factory=time.monotonic)
    outcome: str | None = None
    tokens_seen: int = 0

    @property
    def meta(self) -> Meta:
        assert self.stream.meta is not None
        return self.stream.meta

    @property
    def op(self) -> Op:
        return self.meta.op

    @property
    def request_id(self) -> str:
        return self.stream.req.id

    @property
    def model(self) -> str:
        return self.meta.model

    @property
    def scope(self) -> Scope:
        return Scope(self.meta.org, self.meta.tenant, self.meta.key_id)

    @property
    def reserved_micros(self) -> int:
        return self.meta.reserved_micros


Session = Admitted | Resumed


@dataclass
class Replayed:
    """An Idempotency-Key retry: the stored response, nothing run or charged."""

    status: int
    response: dict[str, Any]
    request_id: str


@dataclass
class Result:
    text: str
    tool_calls: list[dict[str, Any]]
    final: Final


class InferenceService:
    def __init__(
        self,
        cfg: GatewayConfig,
        tenancy: Tenancy,
        accountant: Accountant,
        idempotency: IdempotencyStore,
        ledger: LedgerWriter,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        routes: RouteTable | None = None,
        queue_watch: QueueWatch | None = None,
    ) -> None:
        self.cfg = cfg
        self.tenancy = tenancy
        self.accountant = accountant
        self.idempotency = idempotency
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.routes = routes  # route contracts (None: only cfg.models, no contracts)
        self.queue_watch = queue_watch  # deadline-aware shedding (None: off)
        self.lanes = LaneRouter(cfg.topology)
        dispatcher.on_hedge = lambda cls, outcome: metrics.hedges.labels(cls, outcome).inc()
        self._background: set[asyncio.Task[None]] = set()  # lingering streams, owned
        self.tracer = Tracer(f"jetserve-gateway-{cfg.gateway_id}", cfg.otel_exporter)
        self.coalescer = Coalescer(
            dispatcher, cfg.heartbeat_timeout_s, cfg.max_buffered_frames, metrics.coalesced.inc
        )

    def models(self) -> list[str]:
        routed = self.routes.names() if self.routes is not None else []
        return list(dict.fromkeys([*self.cfg.models, *routed, *self.cfg.embedding_models]))

    # -- admission ---------------------------------------------------------------
    async def admit(self, op: Op, raw: bytes, headers: Mapping[str, str]) -> Admitted | Replayed:
        try:
            key = await self.tenancy.authenticate(headers.get("authorization"))
            parsed, body = parse_body(raw, _KINDS[op])
            idem = headers.get(IDEM_HEADER)
            if idem is not None and getattr(parsed, "stream", False):
                raise BadRequest(
                    "Idempotency-Key applies to non-streaming requests only.", param=IDEM_HEADER
                )
            req = self._build(op, parsed, body, key, headers)
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.code).inc()
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
                req = _with_id(
                    req, claim.request_id, self.dispatcher.reply_for(key.tenant, claim.request_id)
                )
            span.set("jetserve.request_id", req.id)
            return await self._reserve_and_submit(op, parsed, key, req, raw, claim, span)
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            span.end(exc.code)
            if claim is not None:
                await self._idem_fail(claim, raw, exc)
            raise

    async def _reserve_and_submit(
        self,
        op: Op,
        parsed: Parsed,
        key: KeyRecord,
        req: InferenceRequest,
        raw: bytes,
        claim: Claim | None,
        span: Span,
    ) -> Admitted:
        price = self.cfg.prices.for_model(req.model)
        worst = price.worst_case(bound_prompt_tokens(parsed), req.max_tokens)
        scope = Scope.of(key)
        try:
            reservation = await self.accountant.reserve(
                scope, req.id, worst, req.prompt_tokens_est + req.max_tokens
            )
        except (BudgetExceeded, RateLimited) as exc:
            kind = "budget" if isinstance(exc, BudgetExceeded) else "rate"
            await self._append(self._refusal(req, key, f"rejected:{kind}", exc))
            raise
        if reservation.settled:
            raise BadRequest("This request id was already served.", code="duplicate_request")
        # The revision the request was built under (a change may land meanwhile).
        record = (
            self.routes.at(req.route, req.route_revision)
            if self.routes is not None and req.route
            else None
        )
        contract = record.contract if record is not None else None
        hedge = contract.hedge if contract is not None else self.cfg.hedge
        subject = self.lanes.subject(
            req.op,
            req.cls,
            req.tenant,
            req.body,
            contract.routing if contract is not None else self.cfg.routing,
            shared_prefix=contract.coalesce.cross_tenant if contract is not None else False,
        )
        meta = Meta(
            op=req.op,
            model=req.model,
            cls=req.cls,
            tenant=req.tenant,
            deadline=req.deadline,
            created=req.created,
            key_id=req.key_id,
            org=scope.org,
            reserved_micros=reservation.cost_micros,
            price_version=self.cfg.prices.version,
            gateway=self.cfg.gateway_id,
        )
        try:
            self._shed(req)
            coalesce = contract.coalesce if contract is not None else self.cfg.coalesce
            stream = await self.coalescer.submit(
                req,
                None if claim is not None else coalesce,
                lambda: self.dispatcher.submit(
                    req, meta, subject, hedge if hedge.enabled else None
                ),
            )
        except GatewayError as exc:
            await self._release(req.id)
            await self._append(self._refusal(req, key, f"rejected:{exc.code}", exc))
            raise
        self.metrics.inflight.inc()
        return Admitted(op, parsed, key, stream, reservation, raw, claim, span)

    def _shed(self, req: InferenceRequest) -> None:
        """Refuse early what the queue ahead would keep past its deadline."""
        if self.queue_watch is None or not self.cfg.shed:
            return
        first_token_s, _ = self.dispatcher.hedger.quantile(req.cls, 0.5)
        retry_after = self.queue_watch.verdict(req.cls, req.deadline - time.time(), first_token_s)
        if retry_after is not None:
            raise QueueRateLimited(
                "The queue ahead of this request would outlast its deadline; retry later.",
                code="deadline_unmeetable",
                retry_after=retry_after,
            )
        # Counted as queued until the next look at the queue (a coalesced
        # follower too: a slight overestimate, on the safe side).
        self.queue_watch.published(req.cls)

    def _build(
        self,
        op: Op,
        parsed: Parsed,
        body: dict[str, Any],
        key: KeyRecord,
        headers: Mapping[str, str],
    ) -> InferenceRequest:
        served = self.cfg.embedding_models if op == "embedding" else self.cfg.models
        route = self.routes.get(parsed.model) if self.routes is not None else None
        if parsed.model not in served and route is None:
            raise NotFound(f"The model '{parsed.model}' does not exist.", param="model")
        if op == "embedding":
            cls = RequestClass.EMBED
        else:
            wanted = headers.get(CLASS_HEADER, RequestClass.INTERACTIVE.value)
            if wanted not in (RequestClass.INTERACTIVE.value, RequestClass.BATCH.value):
                raise BadRequest(f"Unknown request class '{wanted}'.", param=CLASS_HEADER)
            cls = RequestClass(wanted)
        tools = tuple(
            t.function.name for t in (parsed.tools or [] if isinstance(parsed, ChatRequest) else [])
        )
        data_class = headers.get(DATA_CLASS_HEADER, "default")
        key.scopes.check(model=parsed.model, cls=cls.value, tools=tools, data_class=data_class)
        # A route's deadline is the default; the client may only shorten it.
        timeout = route.contract.deadline_s if route else self.cfg.default_timeout_s
        if TIMEOUT_HEADER in headers:
            try:
                timeout = float(headers[TIMEOUT_HEADER])
            except ValueError:
                raise BadRequest(
                    "X-Jetserve-Timeout must be seconds.", param=TIMEOUT_HEADER
                ) from None
            if not 0 < timeout <= self.cfg.max_timeout_s:
                raise BadRequest(
                    f"X-Jetserve-Timeout must be in (0, {self.cfg.max_timeout_s}].",
                    param=TIMEOUT_HEADER,
                )
            if route is not None:
                timeout = min(timeout, route.contract.deadline_s)
        max_tokens = 0
        if isinstance(parsed, ChatRequest | CompletionRequest):
            max_tokens = parsed.max_tokens or 0
            if isinstance(parsed, ChatRequest) and parsed.max_completion_tokens:
                max_tokens = parsed.max_completion_tokens
            if not max_tokens:
                # The hold is for a bounded output, so the engine gets that bound
                # too (OpenAI's completions default is 16 tokens).
                max_tokens = self.cfg.default_max_tokens if isinstance(parsed, ChatRequest) else 16
                body = {**body, "max_tokens": max_tokens}
        forwarded = {
            k: v
            for k, v in headers.items()
            if any(k.lower().startswith(p) for p in self.cfg.forward_header_prefixes)
        }
        now = time.time()
        request_id = uuid.uuid4().hex
        return InferenceRequest(
            id=request_id,
            op=op,
            cls=cls.value,
            model=parsed.model,
            body=body,
            reply=self.dispatcher.reply_for(key.tenant, request_id),
            deadline=now + timeout,
            tenant=key.tenant,
            key_id=key.key_id,
            traceparent="",  # set by admit(): the request span's own context
            tracestate=headers.get("tracestate", "")[:512],
            prompt_tokens_est=estimate_prompt_tokens(parsed),
            max_tokens=max_tokens,
            created=now,
            headers=forwarded,
            **_route_fields(route),
        )

    # -- the terminal outcome --------------------------------------------------------
    async def finish(
        self, adm: Session, outcome: str, status: int, final: Final | None = None
    ) -> None:
        """The one terminal outcome of a request on this gateway (idempotent).

        Whoever *settles* the budget hold writes the ledger record: when a resumed
        stream is followed by two replicas, the books still get exactly one."""
        if adm.outcome is not None:
            return
        adm.outcome = outcome
        adm.stream.close()
        req = adm.stream.req
        span = adm.span if isinstance(adm, Admitted) else None
        if span is not None:
            if final is not None:
                span.set("gen_ai.usage.input_tokens", final.usage.prompt_tokens)
                span.set("gen_ai.usage.output_tokens", final.usage.completion_tokens)
                span.set("jetserve.attempts", final.attempt)
            span.end(final.finish_reason if final else outcome)
        m = self.metrics
        label = "ok" if final else outcome
        e2e = time.monotonic() - adm.started
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
        else:
            m.requests.labels(adm.op, req.cls, f"resumed_{label}").inc()
        if final is not None:
            usage = final.usage
            m.tokens.labels(req.cls, "input").inc(usage.prompt_tokens)
            m.tokens.labels(req.cls, "output").inc(usage.completion_tokens)
        else:
            # No usage from the engine (cancelled, interrupted): charge what was
            # evidently produced; a request that never started costs nothing.
            usage = Usage(req.prompt_tokens_est if adm.tokens_seen else 0, adm.tokens_seen)
        actual = self.cfg.prices.for_model(req.model).cost(usage)
        coalesced = adm.stream if isinstance(adm.stream, MemberStream) else None
        if coalesced is not None and not coalesced.pays:
            actual = 0  # one shared execution is charged once (gateway/inference/coalesce.py)
        try:
            settled, charge = await self.accountant.settle(req.id, actual)
        except GatewayError as exc:
            # The hold stays until it expires (sweep_expired): never under-held,
            # at worst over-held for a while; this gateway writes the record.
            log.error("reconcile of %s failed: %s", req.id, exc.message)
            settled, charge = True, 0
        if not settled:
            return  # another replica settled it and wrote the record
        claim = adm.claim if isinstance(adm, Admitted) else None
        head = RecordHead.of_request(req, adm.scope, self.cfg.prices.version, self.cfg.gateway_id)
        serving = Serving(
            deployment=final.deployment if final else "",
            fingerprint=self._fingerprint(req, final),
            worker=final.worker if final else "",
            hedged=adm.stream.hedge_seq is not None,
            coalesced_with=coalesced.coalesced_with if coalesced else "",
            first_token_ms=first_ms,
            idempotency_key_hash=claim.key_hash if claim else "",
        )
        await self._append(
            head.settled(
                policy="admitted" if isinstance(adm, Admitted) else "admitted:resumed",
                attempts=_attempts(final.attempt if final else (adm.stream.attempt or 1)),
                usage=usage,
                charge_micros=charge,
                reserved_micros=adm.reserved_micros,
                outcome=final.finish_reason if final else outcome,
                status=status,
                duration_ms=e2e * 1000,
                serving=serving,
            )
        )

    async def fail(self, adm: Session, exc: GatewayError) -> None:
        await self.finish(adm, exc.code, exc.status)
        if isinstance(adm, Admitted) and adm.claim is not None:
            await self._idem_fail(adm.claim, adm.raw, exc)

    async def abandon(self, adm: Session, reason: str = "client_disconnected") -> None:
        """The client went away. Without a resume grace, cancel upstream so the
        engine stops at once; with one, give the client that long to resume."""
        grace = self.cfg.resume_grace_s
        lingering = reason == "client_disconnected" and grace > 0
        if isinstance(adm, Admitted) and adm.wants_stream and lingering and not adm.stream.done:
            task = asyncio.ensure_future(self._linger(adm, reason, grace))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        if isinstance(adm, Resumed):
            # A resumed client left: the original gateway (or the one that took
            # the books) decides about the upstream; we only stop following.
            adm.outcome = "detached"
            adm.stream.close()
            return
        await adm.stream.cancel(reason)
        await self.finish(adm, "cancelled" if reason.startswith("client_d") else reason, 499)

    async def _linger(self, adm: Admitted, reason: str, grace: float) -> None:
        resumed = await self.dispatcher.watch_resumed(adm.request_id)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(resumed.wait(), grace)
            if not resumed.is_set():
                await adm.stream.cancel(reason)
                await self.finish(adm, "cancelled", 499)
                return
            # Resumed (on this replica or another): keep the books by following
            # the stream to its end; the client reads it through the resume.
            while True:
                try:
                    event = await adm.stream.next_event(self.cfg.heartbeat_timeout_s)
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
        self, authorization: str | None, request_id: str, last_seq: int, include_usage: bool
    ) -> Resumed:
        key = await self.tenancy.authenticate(authorization)
        stream = await self.dispatcher.resume(key.tenant, request_id, last_seq)
        if stream is None:
            raise NotFound(
                f"No resumable stream '{request_id}' for this key's tenant.",
                code="stream_not_found",
            )
        return Resumed(stream, include_usage)

    async def aclose(self) -> None:
        """Wait for lingering disconnected streams (bounded by their grace)."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.cfg.resume_grace_s + 5)
        await self.coalescer.aclose()
        self.tracer.shutdown()  # flush exported spans

    async def complete(self, adm: Admitted, response: dict[str, Any]) -> None:
        if adm.claim is not None:
            try:
                await self.idempotency.complete(adm.claim, adm.raw, 200, response)
            except GatewayError as exc:
                log.error("storing idempotent response %s failed: %s", adm.request_id, exc)

    def _refusal(
        self, req: InferenceRequest, key: KeyRecord, policy: str, exc: GatewayError
    ) -> LedgerRecord:
        head = RecordHead.of_request(
            req, Scope.of(key), self.cfg.prices.version, self.cfg.gateway_id
        )
        return head.refused(policy, exc)

    def _fingerprint(self, req: InferenceRequest, final: Final | None) -> str:
        """The serving deployment's fingerprint under the revision the request ran on."""
        if final is None or not final.deployment or not req.route or self.routes is None:
            return ""
        return final.fingerprint or self.routes.fingerprint(
            req.route, req.route_revision, final.deployment
        )

    async def _append(self, record: LedgerRecord) -> None:
        try:
            await self.ledger.append(record)
        except LedgerWriteError as exc:
            self.metrics.rejected.labels("ledger_write_failed").inc()
            log.error("ledger append for %s failed: %s", record.request_id, exc.message)

    async def _release(self, request_id: str) -> None:
        try:
            await self.accountant.release(request_id)
        except GatewayError as exc:
            log.error("release of %s failed: %s", request_id, exc.message)

    async def _idem_fail(self, claim: Claim, raw: bytes, exc: GatewayError) -> None:
        try:
            await self.idempotency.fail(claim, raw, exc)
        except GatewayError as err:
            log.error("idempotency release failed: %s", err.message)

    # -- results -----------------------------------------------------------------
    async def collect(self, adm: Admitted) -> Result:
        """Wait for the whole result (non-streaming clients)."""
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        try:
            async for event in adm.stream.events(self.cfg.heartbeat_timeout_s):
                if isinstance(event, Token):
                    adm.tokens_seen += 1
                    text.append(event.text)
                    if event.tool_calls:
                        merge_tool_calls(calls, event.tool_calls)
                elif isinstance(event, ErrorFrame):
                    raise error_from_frame(event)
                else:
                    await self.finish(adm, "ok", 200, event)
                    return Result("".join(text), calls, event)
        except GatewayError as exc:
            await self.fail(adm, exc)
            raise
        raise AssertionError("frame stream ended without a terminal frame")

    def render(self, adm: Admitted, result: Result) -> dict[str, Any]:
        model = result.final.model or adm.parsed.model
        if isinstance(adm.parsed, EmbeddingRequest):
            return embeddings_response(
                model,
                result.final.embeddings or [],
                result.final.usage,
                adm.parsed.encoding_format,
            )
        return completion_response(
            adm.op,
            adm.request_id,
            model,
            result.text,
            result.tool_calls,
            result.final.finish_reason,
            result.final.usage,
        )


def _route_fields(route: RouteRecord | None) -> dict[str, Any]:
    """What a request carries of its route contract (none: workers use their defaults)."""
    if route is None:
        return {}
    c = route.contract
    names = [d.name for d in c.candidates]
    return {
        "route": c.name,
        "route_revision": route.revision,
        # Without fallback only the preferred deployment may serve it.
        "candidates": names if c.fallback.enabled else names[:1],
        "retry_max": c.retry.max_attempts,
        "retry_on": list(c.retry.on),
    }


def _attempts(attempt: int) -> int:
    """Deliveries of the copy that served (a hedge copy numbers from HEDGE_ATTEMPT_BASE)."""
    return attempt - HEDGE_ATTEMPT_BASE if attempt > HEDGE_ATTEMPT_BASE else attempt


def _with_id(req: InferenceRequest, request_id: str, reply: str) -> InferenceRequest:
    return msgspec.structs.replace(req, id=request_id, reply=reply)

"""Shadow traffic of a route contract's rollout (``rollout.shadow``;
docs/rollout.md): a copy of a share of the route's requests, run by the shadow
candidate and never returned.

A request is shadowed when a hash of its route and id (salted apart from the
canary's) falls under the shadow's share, it is a chat or completion (not an
agent run's model call), and it was queued for real (not a duplicate, not a
coalesced follower). The copy:

- has its own id (``<id>-shadow``) and runs as the operator tenant
  :data:`SHADOW_TENANT`, so its frames are captured under that tenant: no
  client of a real tenant can resume (read) it;
- goes to the ``batch`` subject of the shadow candidate's pool, so it waits
  behind that pool's interactive work, and never to any other deployment;
- is never retried, hedged, coalesced or admitted through the fair gate, and
  never held against the tenant's budget or counted in its rate limits: the
  tenant pays nothing for it;
- is held and charged against the operator tenant's limits instead (its
  budget, rpm and tpm, set like any tenant's), through the same reserve and
  settle scripts: before it is sent, its worst case is reserved; when that is
  refused (the operator budget is spent, a rate limit, Redis down) no copy is
  sent and the refusal is counted (``budget_exhausted`` or ``refused``). The
  real request never sees any of it;
- is read to its end by this gateway (an owned task; at most
  :data:`MAX_INFLIGHT` at once, the rest skipped and counted), and nothing of it
  reaches the client. Tool calls in it are never executed: only the agent
  executor executes tool calls, and it never sees a shadow.

Its ledger record is the operator tenant's, ``shadow: true`` and ``shadow_of``
the request it copies, with its usage, timings, outcome and the charge the
operator tenant's hold was settled to (through the outbox, like any request's).
The comparison (gateway/admin/rollout_analysis.py) pairs it with the copied
request's record. The texts are compared here, in memory, and only the verdicts
are recorded: ``shadow_exact_match`` (both answered, one choice, the request
asked for temperature 0) and ``shadow_json_valid`` (the request asked for a
JSON ``response_format``), and ``shadow_served_json_valid`` (the same check on
the served answer, so the two rates compare). The served request's reader keeps its text for it
(``FrameReader.kept``), and :meth:`Shadows.served` hands it over when the
request ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import msgspec

from gateway.config import GatewayConfig
from gateway.errors import BudgetExceeded, GatewayError
from gateway.inference import rollout
from gateway.inference.dispatch import Dispatcher, FrameStream, error_from_frame
from gateway.inference.pools import PoolView
from gateway.inference.route_table import RouteTable
from gateway.metrics import GatewayMetrics
from gateway.tenancy.accounting import Accountant
from gateway.tenancy.limits import SHADOW_SCOPE, SHADOW_TENANT
from gateway.tenancy.records import RecordHead, Serving
from streams.outbox import Settlement
from streams.pools import adapter_pool
from streams.request_ledger import LedgerRecord
from streams.routes import RouteContract
from streams.subjects import RequestClass, pool_subject
from streams.wire import ErrorFrame, Final, InferenceRequest, Meta, Token, Usage

log = logging.getLogger(__name__)

__all__ = ["SHADOW_SUFFIX", "SHADOW_TENANT", "Shadows", "chosen"]
SHADOW_SUFFIX = "-shadow"
MAX_INFLIGHT = 64  # shadows one gateway reads at once; past it, skipped
SettleFn = Callable[[Settlement], Awaitable[None]]  # the books' outbox (settlements.py)
SERVED_GRACE_S = 5.0  # past the deadline: the served request's books are done by then
JSON_FORMATS = ("json_object", "json_schema")


class Verdicts(NamedTuple):
    """A copy against the served answer; None where a verdict does not apply."""

    exact: bool | None  # same text (temperature 0, one choice, both answered)
    json_valid: bool | None  # the copy's text is JSON (the request asked for JSON)
    served_json_valid: bool | None  # the served text is, too


def _is_json(text: str) -> bool:
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError:
        return False
    return True


def chosen(contract: RouteContract, req: InferenceRequest, key: bytes) -> str | None:
    """The shadow candidate when ``req`` is to be copied, else None (``key``:
    rollout.arms_key, as for the canary split)."""
    policy = contract.rollout.shadow if contract.rollout is not None else None
    if policy is None or req.op == "embedding" or req.cls == RequestClass.AGENT.value:
        return None
    if rollout.position(f"{req.route}\x00shadow", req.id, key) >= policy.share:
        return None
    return policy.candidate


class Shadows:
    def __init__(
        self,
        cfg: GatewayConfig,
        dispatcher: Dispatcher,
        pools: PoolView | None,
        routes: RouteTable | None,
        settle: SettleFn,
        metrics: GatewayMetrics,
        accountant: Accountant,
    ) -> None:
        self.cfg = cfg
        self._arms_key = rollout.arms_key(cfg.key_secret)
        self.accountant = accountant  # the operator tenant's holds and charges
        self.dispatcher = dispatcher
        self.pools = pools
        self.routes = routes
        self._settle = settle
        self.metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()  # owned: cancelled and awaited in aclose()
        # The served answers the running copies wait for: request id -> its text
        # (None: it did not complete).
        self._served: dict[str, asyncio.Future[str | None]] = {}

    def maybe(self, req: InferenceRequest, contract: RouteContract) -> bool:
        """Copy ``req`` to the shadow candidate if the rollout says so (returns at
        once); whether a copy runs (then :meth:`served` must follow)."""
        candidate = chosen(contract, req, self._arms_key)
        if candidate is None or self.pools is None:
            return False
        if req.adapter and not self.pools.holders(req.adapter, [candidate]):
            return False  # the shadow candidate holds no such LoRA adapter
        if len(self._tasks) >= MAX_INFLIGHT:
            self.metrics.rollout_shadows.labels(req.route, "skipped").inc()
            return False
        self._served[req.id] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._run(req, candidate), name=f"shadow-{req.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def served(self, request_id: str, text: str | None) -> None:
        """The copied request ended: its text (None: it did not complete)."""
        fut = self._served.get(request_id)
        if fut is not None and not fut.done():
            fut.set_result(text)

    async def aclose(self) -> None:
        """Shadows still running at shutdown are abandoned (no record)."""
        for fut in self._served.values():
            if not fut.done():
                fut.set_result(None)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, req: InferenceRequest, candidate: str) -> None:
        assert self.pools is not None
        shadow_id = f"{req.id}{SHADOW_SUFFIX}"
        copy = msgspec.structs.replace(
            req,
            id=shadow_id,
            cls=RequestClass.BATCH.value,
            tenant=SHADOW_TENANT,
            key_id="",
            reply=self.dispatcher.reply_for(SHADOW_TENANT, shadow_id),
            candidates=[candidate],
            retry_max=1,
            rollout_arm="",
            attempt_base=0,
        )
        held = await self._hold(copy)
        if held is None:
            self._served.pop(req.id, None)
            return
        started = time.monotonic()
        final: Final | None = None
        outcome, status, tokens = "", 200, 0
        stream: FrameStream | None = None
        try:
            # An adapter's copy goes to the candidate's pool of that adapter.
            pool = adapter_pool(candidate, req.adapter) if req.adapter else candidate
            subject = pool_subject(await self.pools.token(pool), copy.cls)
            stream = await self.dispatcher.submit(copy, self._meta(copy, held), subject)
            stream.kept = []
            async for event in stream.events(self.cfg.heartbeat_timeout_s):
                if isinstance(event, Token):
                    tokens += 1 + len(stream.drain_tokens())
                elif isinstance(event, ErrorFrame):
                    raise error_from_frame(event)
                else:
                    final = event
                    break
        except GatewayError as exc:
            outcome, status = exc.code, exc.status
        finally:
            if stream is not None:
                stream.close()
        text = "".join(stream.kept or []) if stream is not None and final is not None else None
        verdicts = await self._compare(req, text)
        first_ms = None
        if stream is not None and stream.first_token_at is not None:
            first_ms = (stream.first_token_at - started) * 1000
        e2e_ms = (time.monotonic() - started) * 1000
        self.metrics.rollout_shadows.labels(req.route, "ok" if final else "error").inc()
        record = self._record(req, copy, final, outcome, status, tokens, first_ms, e2e_ms, held)
        record = msgspec.structs.replace(
            record,
            shadow_exact_match=verdicts.exact,
            shadow_json_valid=verdicts.json_valid,
            shadow_served_json_valid=verdicts.served_json_valid,
        )
        # Settled like any request: the operator tenant's hold becomes the charge.
        await self._settle(
            Settlement(
                record=record, writer=self.cfg.gateway_id, actual_micros=record.charge_micros
            )
        )

    async def _hold(self, copy: InferenceRequest) -> int | None:
        """Reserve the copy's worst case against the operator tenant's limits
        and return it; None (counted) when refused: no copy is sent. Fails closed, quietly:
        the real request is already on its way and never sees this."""
        price = self.cfg.prices.for_model(copy.model)
        try:
            held = await self.accountant.reserve(
                SHADOW_SCOPE,
                copy.id,
                price.worst_case(copy.prompt_tokens_est, copy.max_tokens),
                copy.prompt_tokens_est + copy.max_tokens,
                hold_s=max(1.0, copy.deadline - time.time()) + self.cfg.settle_grace_s,
            )
        except BudgetExceeded:
            result = "budget_exhausted"
        except GatewayError as exc:  # a rate limit, too large, the store unavailable
            log.info("shadow %s not sent: %s", copy.id, exc.message)
            result = "refused"
        else:
            if not held.settled:
                return held.cost_micros
            result = "refused"  # this copy was already run (never, short of a replayed id)
        self.metrics.rollout_shadows.labels(copy.route, result).inc()
        return None

    async def _compare(self, req: InferenceRequest, text: str | None) -> Verdicts:
        """The verdicts, each None where it does not apply. Waits for
        the served request to end, at most until its deadline and a grace."""
        fut = self._served.get(req.id)
        served = None
        if fut is not None:
            wait = max(0.0, req.deadline - time.time()) + SERVED_GRACE_S
            try:
                served = await asyncio.wait_for(fut, wait)
            except TimeoutError:
                served = None  # its session ended elsewhere (resumed on another replica)
            finally:
                self._served.pop(req.id, None)
        body = req.body
        exact: bool | None = None
        if (
            text is not None
            and served is not None
            and body.get("temperature") == 0
            and body.get("n", 1) == 1
            and body.get("best_of", 1) == 1
        ):
            exact = text == served
        json_valid = served_json = None
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") in JSON_FORMATS:
            json_valid = None if text is None else _is_json(text)
            served_json = None if served is None else _is_json(served)
        return Verdicts(exact, json_valid, served_json)

    def _meta(self, copy: InferenceRequest, reserved_micros: int) -> Meta:
        return Meta(
            op=copy.op,
            model=copy.model,
            cls=copy.cls,
            tenant=SHADOW_TENANT,
            deadline=copy.deadline,
            created=copy.created,
            org=SHADOW_TENANT,
            price_version=self.cfg.prices.version,
            gateway=self.cfg.gateway_id,
            prompt_tokens_est=copy.prompt_tokens_est,
            key_id=SHADOW_SCOPE.key_id,
            reserved_micros=reserved_micros,  # the orphan sweep's evidence (settlements.py)
        )

    def _record(
        self,
        req: InferenceRequest,
        copy: InferenceRequest,
        final: Final | None,
        outcome: str,
        status: int,
        tokens: int,
        first_ms: float | None,
        e2e_ms: float,
        reserved_micros: int,
    ) -> LedgerRecord:
        head = RecordHead.of_request(
            copy, SHADOW_SCOPE, self.cfg.prices.version, self.cfg.gateway_id
        )
        usage = final.usage if final is not None else Usage(0, tokens)
        deployment = final.deployment if final is not None else ""
        fingerprint = final.fingerprint if final is not None else ""
        if deployment and not fingerprint and self.routes is not None:
            fingerprint = self.routes.fingerprint(req.route, req.route_revision, deployment)
        record = head.settled(
            policy="shadow",
            attempts=final.attempt if final is not None else 1,
            usage=usage,
            # The operator tenant's; what Redis charges replaces it (settlements.py).
            charge_micros=self.cfg.prices.for_model(copy.model).cost(usage),
            reserved_micros=reserved_micros,
            outcome=final.finish_reason if final is not None else outcome,
            status=status,
            duration_ms=e2e_ms,
            serving=Serving(
                deployment=deployment,
                fingerprint=fingerprint,
                worker=final.worker if final is not None else "",
                first_token_ms=first_ms,
            ),
        )
        return msgspec.structs.replace(record, shadow=True, shadow_of=req.id)

"""The books of the request path: a request's budget hold reconciled to what it
used, its one ledger record (records built by gateway/tenancy/records.py), the
refusal records, and the idempotency store's side of an outcome. Charges and
records go through the outbox (gateway/inference/settlements.py): a store that
is down delays them, never loses them, and nothing is raised to the request,
whose outcome is already decided."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.errors import BudgetExceeded, GatewayError, RateLimited
from gateway.inference.coalesce import MemberStream
from gateway.inference.route_table import RouteTable
from gateway.inference.sessions import Admitted, Session
from gateway.inference.settlements import Settlements
from gateway.metrics import GatewayMetrics
from gateway.tenancy.accounting import Accountant, Scope
from gateway.tenancy.idempotency import Claim, IdempotencyStore
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.records import RecordHead, Serving
from gateway.tenancy.refusal_records import RefusalRecords
from streams.outbox import Settlement
from streams.request_ledger import LedgerRecord
from streams.wire import HEDGE_ATTEMPT_BASE, Final, InferenceRequest, Usage

log = logging.getLogger(__name__)


class Books:
    def __init__(
        self,
        cfg: GatewayConfig,
        accountant: Accountant,
        idempotency: IdempotencyStore,
        settlements: Settlements,
        metrics: GatewayMetrics,
        routes: RouteTable | None,
    ) -> None:
        self.cfg = cfg
        self.accountant = accountant
        self.idempotency = idempotency
        self.settlements = settlements
        self.metrics = metrics
        self.routes = routes
        self.refusals = RefusalRecords(
            cfg.refusal_records_per_s, cfg.refusal_records_burst, cfg.refusal_summary_s
        )

    async def settle(
        self,
        adm: Session,
        outcome: str,
        status: int,
        final: Final | None,
        duration_s: float,
        first_token_ms: float | None,
    ) -> None:
        """Reconcile the hold to the actual cost and record the outcome. Whoever
        *settles* the hold writes the record: when a resumed stream is followed
        by two replicas, the books still get exactly one."""
        req = adm.stream.req
        if final is not None:
            usage = final.usage
        else:
            # No usage from the engine (cancelled, interrupted): charge what was
            # evidently produced; a request that never started costs nothing.
            usage = Usage(req.prompt_tokens_est if adm.tokens_seen else 0, adm.tokens_seen)
        actual = self.cfg.prices.for_model(req.model).cost(usage)
        coalesced = adm.stream if isinstance(adm.stream, MemberStream) else None
        if coalesced is not None and not await coalesced.charged():
            actual = 0  # one shared execution is charged once (gateway/inference/coalesce.py)
        claim = adm.claim if isinstance(adm, Admitted) else None
        head = RecordHead.of_request(req, adm.scope, self.cfg.prices.version, self.cfg.gateway_id)
        serving = Serving(
            deployment=final.deployment if final else "",
            fingerprint=self._fingerprint(req, final),
            worker=final.worker if final else "",
            hedged=adm.stream.hedged,
            coalesced_with=coalesced.coalesced_with if coalesced else "",
            first_token_ms=first_token_ms,
            idempotency_key_hash=claim.key_hash if claim else "",
        )
        admitted = isinstance(adm, Admitted)
        record = head.settled(
            policy="admitted" if admitted else "admitted:resumed",
            attempts=_attempts(final.attempt if final else (adm.stream.attempt or 1)),
            usage=usage,
            charge_micros=actual,  # what Redis charges replaces it (settlements.py)
            reserved_micros=adm.reserved_micros,
            outcome=final.finish_reason if final else outcome,
            status=status,
            duration_ms=duration_s * 1000,
            serving=serving,
        )
        # Two sessions of one request (the original and a resume) settle apart:
        # the first to reach Redis charges and records, the other records nothing.
        kind = "resumed"
        if isinstance(adm, Admitted):
            kind = "attached" if adm.attached else "admitted"
        writer = f"{self.cfg.gateway_id}/{kind}"
        await self.settlements.settle(
            Settlement(record=record, writer=writer, actual_micros=actual)
        )

    def refusal(
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

    async def refused(self, record: LedgerRecord) -> None:
        """A refusal before any hold: its own record while its tenant's record
        rate allows, else counted into the next summary of its kind
        (gateway/tenancy/refusal_records.py)."""
        if self.refusals.take(record):
            await self.append(record)
        else:
            self.metrics.refusals_summarised.inc()
        await self.summarise()

    async def summarise(self, all_now: bool = False) -> None:
        """Write the summaries whose window is over (``all_now``: every one). All
        are handed to the outbox before the first await: taken out of the counts
        and then cancelled between two writes, the rest were lost."""
        summaries = self.refusals.drain() if all_now else self.refusals.due()
        stored = [
            self.settlements.submit(Settlement(record=r, writer=self.cfg.gateway_id))
            for r in summaries
        ]
        for done in stored:
            await asyncio.shield(done)

    async def append(self, record: LedgerRecord, release: bool = False) -> None:
        """A refusal's record (``release``: with its hold given back), through the outbox."""
        await self.settlements.settle(
            Settlement(
                record=record, writer=self.cfg.gateway_id, actual_micros=0 if release else None
            )
        )

    async def complete(self, adm: Admitted, response: dict[str, Any]) -> None:
        if adm.claim is not None:
            try:
                await self.idempotency.complete(adm.claim, adm.raw, 200, response)
            except (GatewayError, RedisError, OSError) as exc:
                log.error("storing idempotent response %s failed: %r", adm.request_id, exc)

    async def stream_done(self, adm: Admitted) -> None:
        """A streamed run finished: a retry of its key replays its frames."""
        if adm.claim is not None:
            try:
                await self.idempotency.complete(adm.claim, adm.raw, 200, None)
            except (GatewayError, RedisError, OSError) as exc:
                log.error("storing idempotent stream %s failed: %r", adm.request_id, exc)

    async def idem_release(self, claim: Claim) -> None:
        """A run its client cancelled: a retry runs again."""
        try:
            await self.idempotency.release(claim)
        except (RedisError, OSError) as exc:
            log.error("idempotency release failed: %r", exc)

    async def idem_fail(
        self, claim: Claim, raw: bytes, exc: GatewayError, run_over: bool = False
    ) -> None:
        """The run failed (``exc.from_run``; ``run_over``: its deadline passed, so
        it is over whatever this session heard) or this session did: the store
        decides whose claim it is to release (gateway/tenancy/idempotency.py).
        Refused by the accountant (a rate limit, a spent budget: nothing held or
        queued), a fresh claim is forgotten instead."""
        try:
            if _refused_by_accountant(exc) and await self.idempotency.forget(claim):
                return
            await self.idempotency.fail(claim, raw, exc, run_failed=exc.from_run or run_over)
        except GatewayError as err:
            log.error("idempotency release failed: %s", err.message)
        except (RedisError, OSError) as err:
            log.error("idempotency release failed: %r", err)


def _refused_by_accountant(exc: GatewayError) -> bool:
    """A hold the accountant refused (only it raises these two so: a limit named)."""
    return isinstance(exc, BudgetExceeded) or (
        isinstance(exc, RateLimited) and exc.limit is not None
    )


def _attempts(attempt: int) -> int:
    """Deliveries of the copy that served (a hedge copy numbers from HEDGE_ATTEMPT_BASE)."""
    return attempt - HEDGE_ATTEMPT_BASE if attempt > HEDGE_ATTEMPT_BASE else attempt

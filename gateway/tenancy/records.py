"""The one builder of request-ledger records (streams/request_ledger.py).

Inference requests, refusals, agent runs and run settlements all write records;
building them here keeps the columns they share (who, what, when, which
gateway) filled the same way. Who pays is a :class:`Scope`, so the org falls back
to the tenant in one place (``Scope.of``), for admitted and refused records alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec

from gateway.errors import GatewayError
from gateway.tenancy.accounting import MAX_WHAT, ExpiredHold
from gateway.tenancy.limits import Scope
from streams.request_ledger import LedgerRecord
from streams.wire import InferenceRequest, Op, Usage

_NOTE_ENCODER = msgspec.json.Encoder()
# The route column of an agent run's records (its refusal, its hold's, its settlement).
AGENT_RUN_ROUTE = "agent_run"
# The outcome of a request whose gateway died after its hold, before it queued it.
GATEWAY_LOST = "gateway_lost"


@dataclass(frozen=True, slots=True)
class Serving:
    """How an admitted request was served: the columns only a served request fills."""

    deployment: str = ""
    fingerprint: str = ""
    worker: str = ""
    hedged: bool = False
    coalesced_with: str = ""
    first_token_ms: float | None = None
    idempotency_key_hash: str = ""


_NOT_SERVED = Serving()


@dataclass(frozen=True, slots=True)
class RecordHead:
    """What every record of one logical request carries, fixed when it arrives."""

    scope: Scope
    request_id: str
    op: Op
    cls: str
    model: str
    created: float
    price_version: str
    gateway: str
    route: str = ""
    route_revision: int = 0
    rollout_arm: str = ""

    @classmethod
    def of_request(
        cls, req: InferenceRequest, scope: Scope, price_version: str, gateway: str
    ) -> RecordHead:
        return cls(
            scope=scope,
            request_id=req.id,
            op=req.op,
            cls=req.cls,
            model=req.model,
            created=req.created,
            price_version=price_version,
            gateway=gateway,
            route=req.route,
            route_revision=req.route_revision,
            rollout_arm=req.rollout_arm,
        )

    def note(self) -> str:
        """This head as a hold's ``what`` (:meth:`of_hold` reads it back): kept with
        the hold in Redis, it is the record the orphan sweep writes should the
        holder die before anything ran. "" (no note) past ``MAX_WHAT``: a request
        never fails for its note."""
        note = _NOTE_ENCODER.encode(self)
        return note.decode() if len(note) <= MAX_WHAT else ""

    @classmethod
    def of_hold(cls, hold: ExpiredHold) -> RecordHead | None:
        """The head a hold's note gives; None for a hold without one (an older
        gateway's), one that does not decode, or one about another request."""
        if not hold.what:
            return None
        try:
            head = _NOTE_DECODER.decode(hold.what)
        except msgspec.DecodeError:
            return None
        if head.request_id != hold.request_id:
            return None
        # Charged in the org it was held in (its keys' hash tag), as the sweep finds it.
        return replace(head, scope=replace(head.scope, org=hold.org))

    def unqueued(self, reserved_micros: int) -> LedgerRecord:
        """Held, then its gateway died before anything was queued: nothing ran,
        nothing is charged, the client saw its connection drop."""
        return self.settled(
            policy="admitted:released",
            attempts=0,
            usage=Usage(),
            charge_micros=0,
            reserved_micros=reserved_micros,
            outcome=GATEWAY_LOST,
            status=502,
            duration_ms=0.0,
        )

    def refused(self, policy: str, exc: GatewayError) -> LedgerRecord:
        """A request refused before it ran: nothing charged, nothing held."""
        return self.settled(
            policy=policy,
            attempts=0,
            usage=Usage(),
            charge_micros=0,
            reserved_micros=0,
            outcome=exc.code,
            status=exc.status,
            duration_ms=0.0,
        )

    def settled(
        self,
        *,
        policy: str,
        attempts: int,
        usage: Usage,
        charge_micros: int,
        reserved_micros: int,
        outcome: str,
        status: int,
        duration_ms: float,
        serving: Serving = _NOT_SERVED,
    ) -> LedgerRecord:
        return LedgerRecord(
            request_id=self.request_id,
            tenant=self.scope.tenant,
            org=self.scope.org,
            key_id=self.scope.key_id,
            op=self.op,
            cls=self.cls,
            model=self.model,
            route=self.route,
            route_revision=self.route_revision,
            deployment=serving.deployment,
            fingerprint=serving.fingerprint,
            attempts=attempts,
            policy=policy,
            usage=usage,
            price_version=self.price_version,
            charge_micros=charge_micros,
            reserved_micros=reserved_micros,
            outcome=outcome,
            status=status,
            idempotency_key_hash=serving.idempotency_key_hash,
            created=self.created,
            first_token_ms=serving.first_token_ms,
            duration_ms=duration_ms,
            gateway=self.gateway,
            worker=serving.worker,
            hedged=serving.hedged,
            coalesced_with=serving.coalesced_with,
            rollout_arm=self.rollout_arm,
        )


_NOTE_DECODER = msgspec.json.Decoder(RecordHead)

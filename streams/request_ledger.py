"""The request ledger: one record per logical request, in a JetStream stream.

``jetserve.ledger.<tenant>`` (stream ``JETSERVE_LEDGER``) carries
:class:`LedgerRecord`. A record holds accounting facts only (who, which route
and deployment, policy decision, usage, price, charge, outcome, timings), never
prompt or completion text: there is no field for it, and a small
``max_msg_size`` refuses anything that tries to smuggle text in.

One subject per tenant makes tenant isolation structural: a reader filters on
the subject, so it cannot see another tenant's records. Tenant ids are
therefore restricted to one safe subject token.

The writer and reader live in ``gateway.tenancy.request_ledger``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from streams.errors import JetserveError
from streams.ids import is_safe_id
from streams.provision import ensure_stream
from streams.subjects import PREFIX
from streams.wire import Op, Usage


class InvalidTenantError(JetserveError, ValueError):
    code = "invalid_tenant"


class LedgerRecord(msgspec.Struct, frozen=True, tag="ledger", kw_only=True):
    """The accounting record of one logical request (retries and hedges included).

    Money is integer micro-USD, so sums are exact. ``created`` is when the
    gateway accepted the request (unix seconds); range queries filter on it.
    Schema evolution: a new field must have a default, so older readers and
    records keep decoding. ``omit_defaults`` is off on purpose: an exported
    line should show every column.
    """

    request_id: str
    tenant: str
    org: str
    key_id: str
    op: Op
    cls: str
    model: str
    route: str = ""
    route_revision: int = 0
    deployment: str = ""  # the route deployment (name) that served it
    fingerprint: str = ""  # that deployment's fingerprint at route_revision (streams.routes)
    attempts: int
    policy: str  # "admitted", "rejected:budget", "rejected:rate", "rejected:queue_full", ...
    usage: Usage
    price_version: str
    charge_micros: int
    reserved_micros: int
    outcome: str  # finish or termination reason: "stop", "cancelled", an error code, ...
    status: int  # HTTP-ish status the client saw
    idempotency_key_hash: str = ""  # a hash: the client's key itself is not ours to keep
    created: float
    first_token_ms: float | None = None  # None: no token was ever emitted
    duration_ms: float
    gateway: str
    worker: str = ""  # the worker (replica) that served it
    hedged: bool = False  # a second copy raced this request (one extra attempt)
    coalesced_with: str = ""  # followed this request's execution (gateway/inference/coalesce.py)
    # Agent runs: the keys that approved the tree's gated tool calls, in order.
    approved_by: tuple[str, ...] = ()
    # The route's rollout arm that served it: "stable" or "canary" inside a
    # canary's scope (class and tenant), "" outside it (docs/rollout.md).
    rollout_arm: str = ""
    # A shadow copy (gateway/inference/shadow.py): recorded as the operator tenant,
    # never returned nor charged; ``shadow_of`` is the request it copied.
    shadow: bool = False
    shadow_of: str = ""
    # A shadow's comparison with the served answer (the texts themselves are never
    # kept): equal output at temperature 0, and valid JSON where the request asked
    # for it; None: not compared.
    shadow_exact_match: bool | None = None
    shadow_json_valid: bool | None = None
    # On a shadow's record: whether the *served* answer it was compared with
    # was valid JSON (None: not checked, or the served request did not complete).
    shadow_served_json_valid: bool | None = None
    # How many requests the record stands for: 1, or, for a summary of one
    # tenant's refusals past its per-tenant record rate, how many it counts
    # (gateway/tenancy/refusal_records.py).
    count: int = 1


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(LedgerRecord)


def encode_record(record: LedgerRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes) -> LedgerRecord:
    return _decoder.decode(data)


def check_tenant(tenant: str) -> str:
    """A tenant id must be one safe subject token: no '.', '*', '>' or spaces,
    which would let a subject (or a filter) reach other tenants' records."""
    if not is_safe_id(tenant):
        raise InvalidTenantError(f"invalid tenant id for the ledger: {tenant!r}")
    return tenant


DAY_S = 86_400.0


@dataclass(frozen=True)
class LedgerTopology:
    stream: str = "JETSERVE_LEDGER"
    replicas: int = 1  # 3 on a 3-node cluster
    subject_prefix: str = f"{PREFIX}.ledger"
    max_age_s: float = 90 * DAY_S
    max_bytes: int = -1  # unlimited: with limits retention a cap would drop old records
    max_msg_size: int = 64 << 10  # records are ~0.5 KiB; anything big is a bug (or text)
    # Nats-Msg-Id dedupe: a retried append (same request id) within this window
    # is stored once.
    duplicate_window_s: float = 600.0
    # Audit trail: single records can't be deleted through the API. Purging a
    # tenant's subject (offboarding) stays possible. One-way: the server refuses
    # to turn it off again (ensure_ledger then raises ProvisioningError).
    deny_delete: bool = True
    # Reader bounds. Records are appended when a request ends, by the server's
    # clock, and carry the gateway's ``created``: stored time >= created - skew,
    # and stored time <= created + max_append_delay + skew for any record the
    # writer appends in time. The reader uses both to bound its scan.
    clock_skew_s: float = 5.0
    max_append_delay_s: float = DAY_S

    def subject(self, tenant: str) -> str:
        return f"{self.subject_prefix}.{check_tenant(tenant)}"

    def stream_config(self) -> StreamConfig:
        return StreamConfig(
            name=self.stream,
            subjects=[f"{self.subject_prefix}.*"],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_msg_size=self.max_msg_size,
            duplicate_window=self.duplicate_window_s,
            deny_delete=self.deny_delete,
            num_replicas=self.replicas,
        )


DEFAULT_LEDGER = LedgerTopology()


async def ensure_ledger(
    js: JetStreamContext, topo: LedgerTopology = DEFAULT_LEDGER, *, update: bool = True
) -> None:
    """Create the ledger stream or bring it to ``topo`` (``update`` False: create
    it if absent, else leave it: a gateway's credential may not change the audit
    trail, streams/auth.py); safe to call from every process at start-up."""
    await ensure_stream(js, topo.stream_config(), update=update)

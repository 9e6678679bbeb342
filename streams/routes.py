"""Route contracts: the versioned record of how one public model name is served.

A contract names its candidate deployments (order = preference) and the policy
the data plane applies to every request on the route: deadline, retries,
fallback, hedging, routing, coalescing and telemetry. Contracts live in the
NATS KV bucket :data:`ROUTES_BUCKET` (key = route name); the admin API is the
only writer, the data plane watches it.

Each deployment carries a :func:`fingerprint` of every term that can change what
a client gets back (adapter, engine, model, template, precision, KV policy,
batching, hardware, and the route policy), so a ledger record says exactly what
served it.

Validation happens at decode: numeric ranges are msgspec constraints and the
cross-field rules live in ``__post_init__`` (msgspec turns their ``ValueError``
into a ``msgspec.ValidationError`` with the field path).
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any, Literal

import msgspec

from streams.subjects import RequestClass

ROUTES_BUCKET = "jetserve_routes"
ROUTES_HISTORY = 64  # KV history depth per route: how many revisions `history` can show

Adapter = Literal["openai", "tgi", "triton"]
# Worker error codes a retry may be for (``workers.errors``: retryable before the
# first token): connect failure / 5xx / 503, and 429. Nothing else is eligible.
RETRYABLE_CODES = ("engine_unavailable", "engine_rate_limited")
# A deployment or route name: also a KV key, so only KV-safe characters.
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_./=-]+$")]
# What a route name must also be to be applied now (check_new): a KV key (dots only
# between tokens) and a path below /admin/routes/ (slashes only between tokens).
_ROUTE_NAME = re.compile(r"[A-Za-z0-9_=-]+(?:[./][A-Za-z0-9_=-]+)*")
# The admin API's paths below a route (/admin/routes/<name>/<suffix>).
RESERVED_SUFFIXES = frozenset({"status", "history", "diff", "evidence", "rollback"})
Term = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class Deployment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine deployment a route may send requests to. Workers declare the
    deployment they serve by ``name``."""

    name: Name
    adapter: Adapter
    engine: Term  # e.g. "vllm-0.11.0", "jetserve-sim"
    model: Term  # the engine's model id
    template: Term = "default"  # chat template
    precision: Term = "bf16"
    kv_policy: Term = "prefix-cache"
    batching: Term = "continuous"
    hardware: Term = "unspecified"
    # The engine's max_model_len (prompt + output tokens). Set: the gateway
    # refuses (400 context_length_exceeded) what cannot fit, before any hold.
    context_length: Annotated[int, msgspec.Meta(ge=1)] | None = None


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Redelivery before the first token only, inside the original deadline.
    ``on`` holds worker error codes (``workers.errors``); ``max_attempts``
    counts the first try."""

    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=10)] = 3
    on: tuple[Term, ...] = RETRYABLE_CODES

    def __post_init__(self) -> None:
        wrong = [code for code in self.on if code not in RETRYABLE_CODES]
        if wrong:
            raise ValueError(
                f"retry.on: {', '.join(wrong)} not retryable "
                f"(eligible: {', '.join(RETRYABLE_CODES)})"
            )


class FallbackPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Whether a retry may land on another candidate of this contract (never on
    a deployment outside it)."""

    enabled: bool = True


class HedgePolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A second attempt after ``delay`` (the class's p95 first-token delay, or
    seconds) when the first has not emitted; first to emit wins."""

    enabled: bool = False
    delay: Literal["p95"] | Annotated[float, msgspec.Meta(gt=0.0, le=600.0)] = "p95"
    min_samples: Annotated[int, msgspec.Meta(ge=1)] = 20  # before p95 is trusted
    max_extra_ratio: Ratio = 0.1  # extra attempts capped at this share of requests


class RoutingPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["affinity", "round_robin", "least_loaded"] = "affinity"
    prefix_chars: Annotated[int, msgspec.Meta(ge=1)] = 2048  # prefix hashed for affinity
    min_prefix_chars: Annotated[int, msgspec.Meta(ge=0)] = 256  # shorter: no affinity

    def __post_init__(self) -> None:
        if self.min_prefix_chars > self.prefix_chars:
            raise ValueError("routing.min_prefix_chars must not exceed routing.prefix_chars")


class CoalescePolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = False
    cross_tenant: bool = False  # the route marks the prefix shared across tenants


class TelemetryPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    record_content: bool = False
    sample_rate: Ratio = 1.0


# The request classes a canary may be scoped to (streams.subjects.RequestClass).
ROLLOUT_CLASSES = tuple(c.value for c in RequestClass)
Tenant = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


class CanaryPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``share`` of the matching requests (by a hash of the request id, so a
    retry stays on its arm) is served only by ``candidate``; the rest never
    touch it. Empty ``classes`` or ``tenants``: all."""

    candidate: Name
    share: Ratio
    classes: tuple[Term, ...] = ()
    tenants: tuple[Tenant, ...] = ()

    def __post_init__(self) -> None:
        wrong = [c for c in self.classes if c not in ROLLOUT_CLASSES]
        if wrong:
            raise ValueError(
                f"canary.classes: unknown class {', '.join(wrong)} "
                f"(known: {', '.join(ROLLOUT_CLASSES)})"
            )

    def matches(self, cls: str, tenant: str) -> bool:
        return (not self.classes or cls in self.classes) and (
            not self.tenants or tenant in self.tenants
        )


class ShadowPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A copy of ``share`` of the requests for ``candidate``, never answered to
    the client (stored and validated; not executed yet: docs/rollout.md)."""

    candidate: Name
    share: Ratio


class GuardPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When the canary arm fails: over the last ``window_s``, once each arm has
    ``min_samples`` requests, the canary's error rate over the stable arm's
    above ``max_error_ratio``, or its first-token p95 over the stable arm's
    above ``max_ttft_p95_ratio``."""

    min_samples: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 50
    window_s: Annotated[float, msgspec.Meta(gt=0.0, le=86_400.0)] = 60.0
    max_error_ratio: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    max_ttft_p95_ratio: Annotated[float, msgspec.Meta(gt=0.0)] = 1.5


# A route's deployment pools at most: its candidates, each also once per adapter.
MAX_POOLS_PER_ROUTE = 16


class RolloutPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    canary: CanaryPolicy | None = None
    shadow: ShadowPolicy | None = None
    guard: GuardPolicy = GuardPolicy()


class RouteContract(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an operator applies. ``name`` is the model name clients ask for."""

    name: Name
    candidates: Annotated[tuple[Deployment, ...], msgspec.Meta(min_length=1, max_length=64)]
    deadline_s: Annotated[float, msgspec.Meta(gt=0.0, le=86_400.0)] = 60.0
    retry: RetryPolicy = RetryPolicy()
    fallback: FallbackPolicy = FallbackPolicy()
    hedge: HedgePolicy = HedgePolicy()
    routing: RoutingPolicy = RoutingPolicy()
    coalesce: CoalescePolicy = CoalescePolicy()
    telemetry: TelemetryPolicy = TelemetryPolicy()
    description: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # A canary and/or shadow of one candidate (docs/rollout.md); None: none.
    rollout: RolloutPolicy | None = None
    # LoRA adapters (the engine's model ids for them) clients may ask for by
    # name under this route's policy: a request for one goes only to the
    # candidates' workers whose engine holds it (docs/adapters.md).
    adapters: Annotated[tuple[Name, ...], msgspec.Meta(max_length=64)] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for dep in self.candidates:
            if dep.name in seen:
                raise ValueError(f"candidates: deployment name {dep.name!r} appears twice")
            seen.add(dep.name)
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError("adapters: an adapter appears twice")

        if self.name in self.adapters:
            raise ValueError(f"adapters: {self.name!r} is the route's own name")
        if self.rollout is None:
            return
        canary = self.rollout.canary
        if canary is not None:
            if canary.candidate not in seen:
                raise ValueError(
                    f"rollout.canary.candidate: {canary.candidate!r} is not one of the "
                    f"route's candidates ({', '.join(sorted(seen))})"
                )
            if len(seen) < 2:
                raise ValueError(
                    "rollout.canary: the route needs another candidate to serve the stable arm"
                )
        shadow = self.rollout.shadow
        if shadow is not None and shadow.candidate not in seen:
            raise ValueError(
                f"rollout.shadow.candidate: {shadow.candidate!r} is not one of the "
                f"route's candidates ({', '.join(sorted(seen))})"
            )

    def deployment(self, name: str) -> Deployment | None:
        for dep in self.candidates:
            if dep.name == name:
                return dep
        return None


class Rollback(msgspec.Struct, frozen=True, kw_only=True):
    """Why a revision exists: it restores ``to_revision``'s contract (and its
    fingerprints) over ``from_revision``."""

    to_revision: int
    from_revision: int
    reason: str = ""
    automatic: bool = False  # the rollout guard, not an operator


class RolloutEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Published on ``streams.subjects.ROLLOUT_EVENTS`` when the guard rolls a
    route back (the route history keeps the same facts durably)."""

    kind: str = "rolled_back"
    route: str
    revision: int  # the revision the rollback wrote
    from_revision: int
    to_revision: int
    reason: str
    automatic: bool = True
    at: float


class RouteRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the KV holds under the route's key. ``revision`` is the route's own
    revision (1, 2, ... per route), not the KV revision: the admin API numbers it
    from the route's newest message and writes it only while that message is
    still the newest, so one number never names two contracts."""

    contract: RouteContract
    revision: int
    updated_at: float
    updated_by: str
    fingerprints: dict[str, str]  # deployment name -> fingerprint
    # Set on a revision written by a rollback (by hand or by the rollout guard):
    # what it restored, and why. Older records decode with None.
    rollback: Rollback | None = None


# The route-level terms every deployment fingerprint covers. Telemetry and the
# description are left out: they do not change what a client gets back.
_POLICY_TERMS = ("deadline_s", "retry", "fallback", "hedge", "routing", "coalesce")


def fingerprint(dep: Deployment, contract: RouteContract) -> str:
    """sha256 (first 16 hex digits) of the canonical JSON of every deployment
    term plus the route policy terms. Equal inputs give equal output across
    processes; any changed term gives a different one."""
    deployment = msgspec.to_builtins(dep)
    if deployment.get("context_length") is None:
        # Added later: a contract without it keeps the fingerprint it had.
        deployment.pop("context_length", None)
    policy = {k: msgspec.to_builtins(getattr(contract, k)) for k in _POLICY_TERMS}
    if contract.rollout is not None:
        # Added later: a contract without a rollout keeps the fingerprint it had.
        policy["rollout"] = msgspec.to_builtins(contract.rollout)
    if contract.adapters:
        # Added later, likewise.
        policy["adapters"] = list(contract.adapters)
    terms: dict[str, Any] = {"deployment": deployment, "policy": policy}
    canonical = msgspec.json.encode(terms, order="sorted")
    return hashlib.sha256(canonical).hexdigest()[:16]


def fingerprints(contract: RouteContract) -> dict[str, str]:
    return {dep.name: fingerprint(dep, contract) for dep in contract.candidates}


class FieldChange(msgspec.Struct, frozen=True, kw_only=True):
    """One leaf that differs between two contracts. ``path`` is dotted; a
    candidate is addressed by its deployment name (``candidates[name].engine``).
    ``before``/``after`` are None where the leaf is absent on that side."""

    path: str
    before: Any = None
    after: Any = None


def diff_contracts(before: RouteContract | None, after: RouteContract | None) -> list[FieldChange]:
    """Field-level diff; candidates are matched by name, not position, and a
    reorder shows as a change of ``candidates.order``."""
    a = _flatten(before) if before is not None else {}
    b = _flatten(after) if after is not None else {}
    changes = [
        FieldChange(path=k, before=a.get(k), after=b.get(k))
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]
    return changes


def _flatten(contract: RouteContract) -> dict[str, Any]:
    raw = msgspec.to_builtins(contract)
    out: dict[str, Any] = {}
    cands = raw.pop("candidates")
    out["candidates.order"] = [c["name"] for c in cands]
    for cand in cands:
        for k, v in cand.items():
            if k != "name":
                out[f"candidates[{cand['name']}].{k}"] = v
    _walk(raw, "", out)
    return out


def _walk(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = value


_encoder = msgspec.json.Encoder()
_contract_decoder = msgspec.json.Decoder(RouteContract)
_record_decoder = msgspec.json.Decoder(RouteRecord)


def encode(value: RouteContract | RouteRecord) -> bytes:
    """JSON, without the fields added later while they are unset (``rollout``,
    ``rollback``, ``adapters``): a gateway that predates them still reads every
    record that does not use them (``RouteContract`` refuses unknown fields)."""
    raw = msgspec.to_builtins(value)
    contract = raw["contract"] if isinstance(value, RouteRecord) else raw
    if contract.get("rollout", ...) is None:
        del contract["rollout"]
    if "adapters" in contract and not contract["adapters"]:
        del contract["adapters"]
    if isinstance(value, RouteRecord) and raw.get("rollback", ...) is None:
        del raw["rollback"]
    return _encoder.encode(raw)


def check_new(contract: RouteContract) -> RouteContract:
    """The rules a contract meets to be applied now, beyond its fields' own (a
    stored record is never refused by a rule added later: a gateway would stop
    serving it, and nobody could read it to replace it). Raises
    ``msgspec.ValidationError``."""
    name = contract.name
    if not _ROUTE_NAME.fullmatch(name):
        # Taken as it was ("a.", "a..b"), every write of it failed: 503, "unavailable".
        raise msgspec.ValidationError(
            f"name: {name!r} must be tokens of [A-Za-z0-9_=-] joined by single '.' or '/'"
        )
    _, slash, last = name.rpartition("/")
    if slash and last in RESERVED_SUFFIXES:
        # PUT /admin/routes/x/evidence is x's evidence; such a route could not be applied.
        raise msgspec.ValidationError(
            f"name: a route name may not end in '/{last}' (an admin path below a route)"
        )
    pools = len(contract.candidates) * (1 + len(contract.adapters))
    if pools > MAX_POOLS_PER_ROUTE:
        # Each pool is ~132 consumers of the work queue, whose cap (8192) the
        # whole fleet shares (docs/scale.md): one contract must not take it all.
        raise msgspec.ValidationError(
            f"adapters: candidates x (1 + adapters) = {pools} deployment pools; at most "
            f"{MAX_POOLS_PER_ROUTE} per route"
        )
    return contract


def decode_contract(data: bytes | str) -> RouteContract:
    """A contract to apply. Raises ``msgspec.ValidationError`` (bad field, with its
    path) or ``msgspec.DecodeError`` (not JSON)."""
    return check_new(_contract_decoder.decode(data))


def decode_record(data: bytes) -> RouteRecord:
    return _record_decoder.decode(data)


def contract_from_builtins(value: Any) -> RouteContract:
    """Validate an already-parsed mapping (e.g. from YAML) as a contract to apply."""
    return check_new(msgspec.convert(value, RouteContract))

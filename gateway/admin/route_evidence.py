"""Evidence per route revision (streams/evidence.py; docs/rollout.md).

    PUT /admin/routes/{name}/evidence   attach: {"revision": R (default: current),
                                         "approved_by": "...", "conformance": {...},
                                         "bench": {...}, "fault_suite": {...},
                                         "max_age_days": N, "notes": "...",
                                         "measure_slo": true: the route's production
                                         figures now, from the ledger, kept as the
                                         SLO-regression trigger's baseline}
    GET /admin/routes/{name}/evidence   ?revision=R: the evidence of R (default: the
                                         current revision, else the newest earlier
                                         revision that has one) and which
                                         re-evaluation triggers have fired since

An attach merges into the revision's record: an approval is appended,
conformance reports merge per deployment, a bench or fault-suite result
replaces the one before. The record is made on first attach with the
revision's fingerprints and deployment terms, and the gateway's price version.
Reads are leader reads (streams/kv_log.py), like the route history's.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from starlette.requests import Request
from starlette.responses import Response

from gateway import web
from gateway.admin import slo_regression
from gateway.admin.route_contracts import (
    Handler,
    RouteStore,
    nats_guarded,
    not_found,
    revision_not_found,
    revision_param,
    store_of,
)
from gateway.decoding import decode_body
from gateway.errors import BadRequest, Conflict
from gateway.inference.pools import PoolView
from streams.evidence import (
    Evidence,
    Versions,
    decode_evidence,
    encode_evidence,
    ensure_evidence,
    evidence_key,
    new_evidence,
    triggers,
)
from streams.kv_log import KvLog
from streams.routes import RouteRecord

MAX_APPROVALS = 64


class EvidenceUpdate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    revision: int | None = None
    approved_by: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    conformance: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None
    fault_suite: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    max_age_days: Annotated[float, msgspec.Meta(gt=0.0, le=3650.0)] | None = None
    notes: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    slo: dict[str, Any] | None = None  # set by ``measure_slo``, not by the body
    measure_slo: bool = False
    # deployment -> the fingerprint the attached results were measured on (read
    # before the run): checked against the revision's, and kept per item.
    covers: dict[str, str] | None = None


async def read(kv: KeyValue, route: str, revision: int) -> tuple[Evidence, int] | None:
    """The evidence of ``route`` at ``revision`` and its KV sequence; None if none."""
    head = await KvLog.of(kv).last(evidence_key(route, revision))
    if head is None or head.deleted:
        return None
    return decode_evidence(head.value), head.seq


async def newest(
    kv: KeyValue, route: str, start: int, stop: int = 0
) -> tuple[Evidence, int] | None:
    """The evidence of the newest revision of ``route`` at or before ``start``
    (and after ``stop``) that has one, with its KV sequence; None if none."""
    for rev in range(start, stop, -1):
        found = await read(kv, route, rev)
        if found is not None:
            return found
    return None


def live_versions(pools: PoolView | None, record: RouteRecord) -> Versions:
    """Per candidate deployment, the engine versions its live workers report
    now (as this gateway sees the members); deployments with none left out."""
    out: Versions = {}
    for dep in record.contract.candidates if pools is not None else ():
        assert pools is not None
        found = tuple(v for v in pools.engine_versions(dep.name) or () if v)
        if found:
            out[dep.name] = found
    return out


async def merge(
    kv: KeyValue,
    record: RouteRecord,
    price_version: str,
    update: EvidenceUpdate,
    versions: Versions | None = None,
) -> Evidence:
    """Merge ``update`` into ``record``'s evidence (made on first use), compare-and-set.
    ``versions`` (what the workers report now) are kept when the record is made
    and on each approval: an approval covers the engines running now."""
    key = evidence_key(record.contract.name, record.revision)
    for _ in range(4):
        found = await read(kv, record.contract.name, record.revision)
        base = found[0] if found else new_evidence(record, price_version, versions=versions)
        merged = _merged(base, update)
        if found and update.approved_by is not None and versions:
            merged = msgspec.structs.replace(merged, engine_versions=versions)
        try:
            if found is None:
                await kv.create(key, encode_evidence(merged))
            else:
                await kv.update(key, encode_evidence(merged), last=found[1])
        except KeyWrongLastSequenceError:
            continue  # another attach came first: merge onto it
        return merged
    raise Conflict(
        f"The evidence of {record.contract.name} r{record.revision} kept changing; try again.",
        code="evidence_conflict",
    )


def attached_items(u: EvidenceUpdate) -> list[str]:
    """The results an update attaches, by the names ``Evidence.checked`` uses."""
    items = [f"conformance/{dep}" for dep in u.conformance or {}]
    return items + [name for name in ("bench", "fault_suite") if getattr(u, name) is not None]


def check_covers(record: RouteRecord, u: EvidenceUpdate) -> None:
    """``covers`` must name the revision's deployments at their fingerprints, and
    every deployment whose conformance report is attached."""
    if u.covers is None:
        return
    if not attached_items(u):
        raise BadRequest(
            "'covers' says what attached results were measured on: attach some.", param="covers"
        )
    unknown = sorted(u.covers.keys() - record.fingerprints.keys())
    if unknown:
        raise BadRequest(
            f"'covers' names deployments revision {record.revision} does not have: {unknown}",
            param="covers",
        )
    missing = sorted((u.conformance or {}).keys() - u.covers.keys())
    if missing:
        raise BadRequest(
            f"'covers' must name {missing} (their reports are attached)", param="covers"
        )
    stale = {d: fp for d, fp in u.covers.items() if record.fingerprints[d] != fp}
    if stale:
        detail = ", ".join(
            f"{d}: measured on {fp}, revision {record.revision} has {record.fingerprints[d]}"
            for d, fp in sorted(stale.items())
        )
        raise Conflict(
            f"The results were measured on other fingerprints than {record.contract.name} "
            f"r{record.revision}'s ({detail}); measure again.",
            code="evidence_fingerprint_mismatch",
        )


def _merged(base: Evidence, u: EvidenceUpdate) -> Evidence:
    approved = base.approved_by
    if u.approved_by is not None and u.approved_by not in approved:
        approved = (*approved, u.approved_by)[-MAX_APPROVALS:]
    checked = dict(base.checked)
    for item in attached_items(u):
        if u.covers is None:
            checked.pop(item, None)  # replaced by a result taken as given
        else:
            deps = [item.split("/", 1)[1]] if item.startswith("conformance/") else u.covers
            checked[item] = {d: u.covers[d] for d in deps}
    return msgspec.structs.replace(
        base,
        checked=checked,
        updated_at=time.time(),
        approved_by=approved,
        conformance={**base.conformance, **(u.conformance or {})},
        bench=u.bench if u.bench is not None else base.bench,
        fault_suite=u.fault_suite if u.fault_suite is not None else base.fault_suite,
        guard=u.guard if u.guard is not None else base.guard,
        slo=u.slo if u.slo is not None else base.slo,
        max_age_days=u.max_age_days if u.max_age_days is not None else base.max_age_days,
        notes=u.notes if u.notes is not None else base.notes,
    )


async def _kv(request: Request) -> KeyValue:
    rt = request.app.state.rt
    kv: KeyValue = await ensure_evidence(rt.js, rt.cfg.topology.replicas)
    return kv


async def _revision(s: RouteStore, name: str, revision: int | None) -> RouteRecord:
    if revision is None:
        cur = await s.current(name)
        if cur is None:
            raise not_found(name)
        return cur[0]
    for entry in await s.history(name):
        if entry.record is not None and entry.record.revision == revision:
            return entry.record
    raise revision_not_found(name, revision)


async def attach(request: Request) -> Response:
    name = request.path_params["name"]
    update = decode_body(await request.body() or b"{}", EvidenceUpdate)
    if update.slo is not None:
        raise BadRequest("'slo' is measured by the gateway: ask for measure_slo.", param="slo")
    record = await _revision(store_of(request), name, update.revision)
    check_covers(record, update)
    if update.measure_slo:
        update = await _measured(request, record, update)
    rt = request.app.state.rt
    price_version: str = rt.cfg.prices.version
    versions = live_versions(rt.gateway.pools, record)
    evidence = await merge(await _kv(request), record, price_version, update, versions)
    return web.json_response(msgspec.to_builtins(evidence))


async def _measured(
    request: Request, record: RouteRecord, update: EvidenceUpdate
) -> EvidenceUpdate:
    """``update`` with the route's production figures at ``record``'s revision."""
    now = time.time()
    found = await slo_regression.measure(request.app.state.rt.ledger_reader, record, now)
    if found.requests == 0:
        raise BadRequest(
            f"No request of {record.contract.name} r{record.revision} in the last "
            f"{slo_regression.policy_of(record).window_s:g}s to measure.",
            code="nothing_to_measure",
            param="measure_slo",
        )
    return msgspec.structs.replace(update, slo=slo_regression.slo_of(found, record, now))


async def show(request: Request) -> Response:
    name = request.path_params["name"]
    s = store_of(request)
    cur = await s.current(name)
    if cur is None:
        raise not_found(name)
    current = cur[0]
    asked = revision_param(request, "revision")
    if asked is not None and asked > current.revision:
        # Read revision by revision down from it: a huge number was an endless scan.
        raise revision_not_found(name, asked)
    start = asked or current.revision
    found = await newest(await _kv(request), name, start)
    price_version: str = request.app.state.rt.cfg.prices.version
    if found is None:
        return web.json_response(
            {
                "name": name,
                "current_revision": current.revision,
                "evidence": None,
                "triggers": [],
                "due": True,
                "reason": "no evidence recorded for this route",
            }
        )
    evidence = found[0]
    versions = live_versions(request.app.state.rt.gateway.pools, current)
    fired = triggers(evidence, current, price_version, time.time(), versions)
    slo = await slo_regression.slo_trigger(request.app.state.rt.ledger_reader, evidence, current)
    if slo is not None:
        fired.append(slo)
    reason = (
        "; ".join(f"{t.kind}: {t.detail}" for t in fired)
        if fired
        else f"revision {evidence.revision}'s evidence still holds"
    )
    return web.json_response(
        {
            "name": name,
            "current_revision": current.revision,
            "evidence": msgspec.to_builtins(evidence),
            "triggers": msgspec.to_builtins(fired),
            "due": bool(fired),
            "reason": reason,
        }
    )


# Before the contract routes: ``{name:path}`` would otherwise take the suffix.
EVIDENCE_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("/admin/routes/{name:path}/evidence", "PUT", nats_guarded(attach)),
    ("/admin/routes/{name:path}/evidence", "GET", nats_guarded(show)),
)

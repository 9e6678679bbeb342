"""Evidence records: what a route revision was judged on, kept beside the route
history, and the triggers that say when to judge it again (docs/rollout.md).

One record per route revision in the NATS KV bucket :data:`EVIDENCE_BUCKET`
(key :func:`evidence_key`). Operators attach what they checked (conformance
reports, the last bench and fault-suite results, an approval); the rollout
guard attaches its final figures when it rolls a revision back. The record
keeps the revision's fingerprints and deployment terms as they were, so a
later revision can be compared with it. The admin API is the only writer.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from streams.provision import ensure_bucket
from streams.routes import RouteRecord

EVIDENCE_BUCKET = "jetserve_evidence"
DAY_S = 86_400.0


class Evidence(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    revision: int
    recorded_at: float
    updated_at: float
    fingerprints: dict[str, str]  # the revision's, deployment -> fingerprint
    terms: dict[str, dict[str, str]]  # deployment -> {adapter, engine}, as evidenced
    # deployment -> the engine versions its live workers reported (streams/membership.py)
    # when the record was made or last approved; absent: none reported.
    engine_versions: dict[str, tuple[str, ...]] = {}
    price_version: str = ""  # the gateway's price table when first recorded
    max_age_days: float = 30.0  # past it, the evidence is due again
    approved_by: tuple[str, ...] = ()
    conformance: dict[str, Any] = {}  # deployment -> its adapter's conformance report
    bench: dict[str, Any] = {}  # the last bench result for these fingerprints
    fault_suite: dict[str, Any] = {}
    guard: dict[str, Any] = {}  # the rollout guard's final figures (gateway/admin/rollout_guard.py)
    # Production figures measured at attach (``measure_slo``): the SLO-regression
    # trigger's baseline (gateway/admin/slo_regression.py). Absent in older records.
    slo: dict[str, Any] = {}
    # For each attached item ("bench", "fault_suite", "conformance/<deployment>"):
    # the fingerprints it was measured on (deployment -> fingerprint), checked
    # equal to the revision's when attached; an item absent here was taken as given.
    checked: dict[str, dict[str, str]] = {}
    notes: str = ""


class Trigger(msgspec.Struct, frozen=True, kw_only=True):
    """A reason to re-evaluate: ``kind`` and what changed."""

    # fingerprint_changed | adapter_changed | engine_changed | engine_version_changed
    # | price_changed | expired | slo_regression (gateway/admin/slo_regression.py:
    # it reads the ledger)
    kind: str
    detail: str


class EvidenceDueEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Published on ``streams.subjects.ROLLOUT_EVENTS`` when the evidence watch
    (gateway/admin/evidence_watch.py) sees triggers fire on a route."""

    kind: str = "evidence_due"
    route: str
    revision: int  # the route's current revision
    evidence_revision: int  # the revision whose evidence no longer holds
    triggers: tuple[Trigger, ...]  # those newly fired
    at: float


def evidence_key(route: str, revision: int) -> str:
    return f"{route}/r{revision}"


Versions = dict[str, tuple[str, ...]]  # deployment -> engine versions its workers report


def new_evidence(
    record: RouteRecord,
    price_version: str,
    now: float | None = None,
    versions: Versions | None = None,
) -> Evidence:
    at = time.time() if now is None else now
    return Evidence(
        route=record.contract.name,
        revision=record.revision,
        recorded_at=at,
        updated_at=at,
        fingerprints=dict(record.fingerprints),
        terms={
            d.name: {"adapter": d.adapter, "engine": d.engine} for d in record.contract.candidates
        },
        price_version=price_version,
        engine_versions=versions or {},
    )


def triggers(
    evidence: Evidence,
    current: RouteRecord,
    price_version: str,
    now: float,
    versions: Versions | None = None,
) -> list[Trigger]:
    """Which re-evaluation triggers have fired since ``evidence`` was recorded;
    ``versions``: what the deployments' live workers report now (a deployment
    with no live worker, or none that says, is not compared)."""
    fired: list[Trigger] = []
    now_fps = current.fingerprints
    for name in sorted(evidence.fingerprints.keys() | now_fps.keys()):
        before, after = evidence.fingerprints.get(name), now_fps.get(name)
        if before != after:
            fired.append(
                Trigger(
                    kind="fingerprint_changed",
                    detail=f"{name}: {before or '(absent)'} -> {after or '(absent)'}",
                )
            )
    for dep in current.contract.candidates:
        was = evidence.terms.get(dep.name)
        if was is None:
            continue
        for term in ("adapter", "engine"):
            now_term = getattr(dep, term)
            if was.get(term) != now_term:
                fired.append(
                    Trigger(
                        kind=f"{term}_changed", detail=f"{dep.name}: {was.get(term)} -> {now_term}"
                    )
                )
    for name, was_built in sorted(evidence.engine_versions.items()):
        now_built = (versions or {}).get(name)
        if was_built and now_built and tuple(was_built) != now_built:
            fired.append(
                Trigger(
                    kind="engine_version_changed",
                    detail=f"{name}: {', '.join(was_built)} -> {', '.join(now_built)}",
                )
            )
    if evidence.price_version and evidence.price_version != price_version:
        fired.append(
            Trigger(kind="price_changed", detail=f"{evidence.price_version} -> {price_version}")
        )
    due = evidence.recorded_at + evidence.max_age_days * DAY_S
    if now >= due:
        fired.append(Trigger(kind="expired", detail=f"older than {evidence.max_age_days:g} days"))
    return fired


def evidence_config(replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=EVIDENCE_BUCKET,
        description="jetserve evidence per route revision (written by the admin API only)",
        history=8,
        max_value_size=256 << 10,
        storage=StorageType.FILE,
        replicas=replicas,
    )


async def bind_evidence(js: JetStreamContext) -> KeyValue | None:
    """The evidence bucket if anyone has made it (an attach), else None: a
    watcher must not make it."""
    try:
        return await js.key_value(EVIDENCE_BUCKET)
    except BucketNotFoundError:
        return None


async def ensure_evidence(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """Bind the evidence bucket, creating it if absent (concurrent-safe)."""
    return await ensure_bucket(js, evidence_config(replicas))


_decoder = msgspec.json.Decoder(Evidence)


def encode_evidence(evidence: Evidence) -> bytes:
    return msgspec.json.encode(evidence)


def decode_evidence(data: bytes) -> Evidence:
    return _decoder.decode(data)

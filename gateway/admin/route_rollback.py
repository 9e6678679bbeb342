"""Rolling a route back to an earlier revision (docs/rollout.md).

    POST /admin/routes/{name}/rollback   {"to": R (optional), "reason": "...",
                                          "expected_revision": C (optional)}

A rollback is a new revision, numbered on like any apply, whose contract *and*
fingerprints are copied from revision ``to`` as the route history keeps it: the
data plane serves exactly what it served under ``to``, and the ledger's
fingerprints match ``to``'s. The record says so (``rollback``: to, from, reason,
automatic), so the history shows every rollback and why. Without ``to``, the
target is the newest earlier revision whose contract differs from the current
one. The write is compare-and-set like an apply: a concurrent change gets 409.

The rollout guard (gateway/admin/rollout_guard.py) rolls back through
:func:`roll_back`, the same code as the endpoint.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from starlette.requests import Request
from starlette.responses import Response

from gateway import web
from gateway.admin.route_contracts import (
    ACTOR_HEADER,
    Handler,
    RouteStore,
    live,
    nats_guarded,
    next_revision,
    not_found,
    revision_not_found,
    store_of,
    view,
)
from gateway.errors import BadRequest, Conflict
from gateway.metrics import GatewayMetrics
from streams.routes import Rollback, RouteRecord

MAX_REASON = 512


class RouteConflict(Conflict):
    """The route is not at the revision the caller judged (or changed meanwhile)."""

    code = "route_conflict"

    def __init__(self, message: str, current: int) -> None:
        super().__init__(message, param="expected_revision")
        self.current = current

    def body(self) -> dict[str, Any]:
        return {**super().body(), "current_revision": self.current}


class RollbackRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    to: int | None = None
    reason: str = ""
    expected_revision: int | None = None  # refuse unless the route is still at this revision


async def roll_back(
    store: RouteStore,
    name: str,
    *,
    to: int | None,
    reason: str,
    actor: str,
    automatic: bool = False,
    expected: int | None = None,
    without_canary: str | None = None,
) -> tuple[RouteRecord, bool]:
    """Write a revision restoring ``to``'s contract and fingerprints; the record
    now in force and whether it was written (False: the route already serves
    that contract). ``without_canary`` (with no ``to``): the target is the
    newest earlier revision that does not canary that deployment (the guard's
    choice, so a failed canary is never rolled back onto a smaller share of
    itself). Raises NotFound, BadRequest or :class:`RouteConflict`."""
    head = await store.head(name)
    cur = live(head)
    if cur is None:
        raise not_found(name)
    current = cur[0]
    if expected is not None and expected != current.revision:
        raise RouteConflict(
            f"Route '{name}' is at revision {current.revision}, not {expected}.", current.revision
        )
    if to is not None and to >= current.revision:
        raise BadRequest(
            f"Route '{name}' is at revision {current.revision}: roll back to an earlier one.",
            param="to",
        )
    records = [e.record for e in await store.history(name) if e.record is not None]
    target = _target(records, current, to, without_canary)
    if target is None:
        if to is not None:
            raise revision_not_found(name, to)
        raise BadRequest(
            f"Route '{name}' has no earlier revision with another contract to roll back to.",
            code="no_earlier_revision",
            param="to",
        )
    if target.contract == current.contract and target.fingerprints == current.fingerprints:
        return current, False
    record = RouteRecord(
        contract=target.contract,
        revision=await next_revision(store, name, head),
        updated_at=time.time(),
        updated_by=actor,
        fingerprints=dict(target.fingerprints),  # exactly the earlier ones
        rollback=Rollback(
            to_revision=target.revision,
            from_revision=current.revision,
            reason=reason[:MAX_REASON],
            automatic=automatic,
        ),
    )
    try:
        await store.write(name, head, record)
    except KeyWrongLastSequenceError:
        now = await store.current(name)
        now_rev = now[0].revision if now else 0
        raise RouteConflict(
            f"Route '{name}' changed concurrently (now revision {now_rev}).", now_rev
        ) from None
    return record, True


def _target(
    records: list[RouteRecord], current: RouteRecord, to: int | None, without_canary: str | None
) -> RouteRecord | None:
    if to is not None:
        return next((r for r in records if r.revision == to), None)
    earlier = [
        r
        for r in records
        if r.revision < current.revision
        and r.contract != current.contract
        and (without_canary is None or _canary_of(r) != without_canary)
    ]
    return earlier[-1] if earlier else None


def _canary_of(record: RouteRecord) -> str | None:
    rollout = record.contract.rollout
    return rollout.canary.candidate if rollout is not None and rollout.canary else None


async def rollback(request: Request) -> Response:
    name = request.path_params["name"]
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw or b"{}", type=RollbackRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid rollback request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from exc
    actor = request.headers.get(ACTOR_HEADER, "admin")[:128] or "admin"
    record, changed = await roll_back(
        store_of(request),
        name,
        to=body.to,
        reason=body.reason,
        actor=actor,
        expected=body.expected_revision,
    )
    if changed:
        metrics: GatewayMetrics = request.app.state.rt.gateway.metrics
        metrics.rollout_rollbacks.labels(name, "manual").inc()
    return web.json_response({**view(record), "changed": changed})


# Before the contract routes: ``{name:path}`` would otherwise take the suffix.
ROLLBACK_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("/admin/routes/{name:path}/rollback", "POST", nats_guarded(rollback)),
)

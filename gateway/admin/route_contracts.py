"""The admin API for route contracts: the only writer of the ``jetserve_routes`` bucket.

    PUT    /admin/routes/{name}          apply a contract (+ optional expected_revision)
    GET    /admin/routes                 every route: revision, fingerprints
    GET    /admin/routes/{name}          the current record
    GET    /admin/routes/{name}/history  every revision the bucket keeps, oldest first
    GET    /admin/routes/{name}/diff     ?from=R1&to=R2 (default: previous -> current)
    DELETE /admin/routes/{name}          (optional ?expected_revision=R)

Revisions count per route (1, 2, ...) and are stored in the record; the KV
revision of the entry is the compare-and-set token, so two admins never
overwrite each other silently: the loser gets 409 with the current revision.
Applying a contract equal to the current one writes nothing.

Reads are the admin API's own writes (read-your-writes): show, diff, history and
list read the bucket's stream on its leader (``streams.kv_log``), so once an
apply has returned revision N every gateway's admin API answers with N. The
next revision number comes from the route's newest message (a record, or a
delete marker that carries the revision it deleted) and the write is
conditional on that message still being the newest, so a number never names
two contracts.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
from nats.js.api import Header as NatsHeader
from nats.js.errors import APIError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_OP, KeyValue
from starlette.requests import Request
from starlette.responses import Response

from gateway import web
from gateway.decoding import decode_json
from gateway.errors import BadRequest, GatewayError, NotFound, RequestTooLarge, Unavailable
from gateway.inference.route_table import RouteTable
from streams.headers import Header
from streams.kv_log import KvLog, KvMessage
from streams.routes import (
    RouteContract,
    RouteRecord,
    check_new,
    decode_record,
    diff_contracts,
    encode,
    fingerprints,
)

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]
ACTOR_HEADER = "x-jetserve-actor"  # who applies (the CLI sends user@host); kept in the record
LOCAL_PICKUP_S = 2.0  # how long an apply waits for this gateway's table to show it
_WRONG_LAST_SEQUENCE = 10071  # JetStream: expected last subject sequence mismatch
_NAMED_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*): ")


class _Entry(msgspec.Struct, frozen=True):
    """One version in a route's history: a record, or a delete marker."""

    kv_revision: int
    record: RouteRecord | None
    at: float


def view(record: RouteRecord) -> dict[str, Any]:
    out = {
        "name": record.contract.name,
        "revision": record.revision,
        "updated_at": record.updated_at,
        "updated_by": record.updated_by,
        "fingerprints": record.fingerprints,
        "contract": msgspec.to_builtins(record.contract),
    }
    if record.rollback is not None:
        out["rollback"] = msgspec.to_builtins(record.rollback)
    return out


def conflict(name: str, current: int, message: str) -> Response:
    err = BadRequest(message, code="route_conflict", param="expected_revision", status=409)
    return web.json_response({**err.body(), "current_revision": current}, 409)


class RouteStore:
    """Reads and compare-and-set writes of route records in the KV bucket.

    Every read goes to the bucket's stream leader by subject or by sequence
    (:class:`streams.kv_log.KvLog`), never through a watch or a direct get: a
    write the store acknowledged is in every later read, on any gateway, and
    an empty answer means the leader holds nothing for the key."""

    def __init__(self, kv: KeyValue, table: RouteTable | None = None) -> None:
        self.kv = kv
        self.table = table
        self.log = KvLog.of(kv)

    async def head(self, name: str) -> KvMessage | None:
        """The route's newest message (a delete marker included); None if none."""
        return await self.log.last(name)

    async def current(self, name: str) -> tuple[RouteRecord, int] | None:
        """The live record and its KV revision; None if absent or deleted."""
        return live(await self.head(name))

    async def history(self, name: str) -> list[_Entry]:
        out = []
        for m in await self.log.history(name):
            record = None if m.deleted else decode_record(m.value)
            out.append(_Entry(m.seq, record, record.updated_at if record else m.at))
        return out

    async def names(self) -> list[str]:
        """Every route with a message in the bucket (deleted ones included)."""
        return await self.log.keys()

    async def write(self, name: str, head: KvMessage | None, record: RouteRecord) -> int:
        """Store ``record`` only if ``head`` is still the route's newest message
        (None: the route has none), then wait (bounded) until this gateway's
        table shows it; the KV revision. Raises ``KeyWrongLastSequenceError``
        when another write came first."""
        kv_rev = await self.kv.update(name, encode(record), last=head.seq if head else 0)
        if self.table is not None and not await self.table.wait_for(kv_rev, LOCAL_PICKUP_S):
            log.warning(
                "route %s revision %d (kv %d) stored, but not in this gateway's table after %gs",
                name,
                record.revision,
                kv_rev,
                LOCAL_PICKUP_S,
            )
        return kv_rev

    async def delete(self, name: str, record: RouteRecord, kv_revision: int) -> None:
        """A delete marker, if ``kv_revision`` is still the newest message (else
        an APIError 10071), carrying the revision it deleted."""
        await self.log.js.publish(
            self.log.subject(name),
            b"",
            headers={
                KV_OP: KV_DEL,
                NatsHeader.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(kv_revision),
                Header.ROUTE_REVISION: str(record.revision),
            },
        )


def live(head: KvMessage | None) -> tuple[RouteRecord, int] | None:
    if head is None or head.deleted:
        return None
    return decode_record(head.value), head.seq


def store_of(request: Request) -> RouteStore:
    table: RouteTable | None = request.app.state.rt.gateway.routes
    if table is None:
        raise Unavailable("This gateway has no route table.")
    return RouteStore(table.kv, table)


# JetStream's "message size exceeds maximum allowed": the write can never succeed.
_TOO_BIG = 10054


def nats_guarded(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except nats.errors.MaxPayloadError as exc:
            raise _too_big(exc) from exc
        except APIError as exc:
            if exc.err_code == _TOO_BIG:
                raise _too_big(exc) from exc
            raise Unavailable(f"The route store (NATS KV) is unavailable: {exc}") from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise Unavailable(f"The route store (NATS KV) is unavailable: {exc}") from exc

    return wrapped


def _too_big(exc: Exception) -> RequestTooLarge:
    # A retryable 503 ("unavailable") before: an operator's script retried it for ever.
    return RequestTooLarge(f"Too large for the route store: {exc}")


async def next_revision(s: RouteStore, name: str, head: KvMessage | None) -> int:
    """The revision after the route's newest message. A number is never reused:
    it comes from that one message (read on the stream leader), and the write
    is conditional on that message still being the newest."""
    if head is None:
        return 1  # the leader holds no message for the route: it never existed
    if not head.deleted:
        return decode_record(head.value).revision + 1
    marked = head.headers.get(Header.ROUTE_REVISION, "")
    if marked.isdigit():
        return int(marked) + 1
    # A delete marker written without the revision (by an older gateway):
    # numbering continues from the records the history keeps.
    records = [e.record.revision for e in await s.history(name) if e.record is not None]
    return 1 + max(records, default=0)


async def apply(request: Request) -> Response:
    name = request.path_params["name"]
    contract, expected = _parse_apply(await request.body())
    if contract.name != name:
        raise BadRequest(
            f"The contract names route '{contract.name}', the path '{name}'.", param="name"
        )
    s = store_of(request)
    head = await s.head(name)
    cur = live(head)
    cur_rev = cur[0].revision if cur else 0
    if expected is not None and expected != cur_rev:
        return conflict(name, cur_rev, f"Route '{name}' is at revision {cur_rev}, not {expected}.")
    if cur is not None and cur[0].contract == contract:
        return web.json_response({**view(cur[0]), "changed": False})
    actor = request.headers.get(ACTOR_HEADER, "admin")[:128] or "admin"
    record = RouteRecord(
        contract=contract,
        revision=await next_revision(s, name, head),
        updated_at=time.time(),
        updated_by=actor,
        fingerprints=fingerprints(contract),
    )
    try:
        # Only if the message the revision was numbered from is still the newest
        # (0: the route has no message at all).
        await s.write(name, head, record)
    except KeyWrongLastSequenceError:
        now = await s.current(name)
        now_rev = now[0].revision if now else 0
        return conflict(
            name, now_rev, f"Route '{name}' changed concurrently (now revision {now_rev})."
        )
    return web.json_response({**view(record), "changed": True}, 201 if cur is None else 200)


async def list_routes(request: Request) -> Response:
    s = store_of(request)
    data = []
    for name in await s.names():
        cur = await s.current(name)
        if cur is not None:
            data.append(view(cur[0]))
    return web.json_response({"data": data})


async def show(request: Request) -> Response:
    name = request.path_params["name"]
    cur = await store_of(request).current(name)
    if cur is None:
        raise not_found(name)
    return web.json_response(view(cur[0]))


async def history(request: Request) -> Response:
    name = request.path_params["name"]
    entries = await store_of(request).history(name)
    if not entries:
        raise not_found(name)
    data = [
        view(e.record)
        if e.record is not None
        else {"name": name, "deleted": True, "updated_at": e.at}
        for e in entries
    ]
    return web.json_response({"name": name, "data": data})


async def diff(request: Request) -> Response:
    name = request.path_params["name"]
    records = [e.record for e in await store_of(request).history(name) if e.record is not None]
    if not records:
        raise not_found(name)
    by_rev = {r.revision: r for r in records}
    to_rev = revision_param(request, "to")
    from_rev = revision_param(request, "from")
    after = records[-1] if to_rev is None else by_rev.get(to_rev)
    if after is None:
        raise revision_not_found(name, to_rev)
    before: RouteRecord | None
    if from_rev is None:
        older = [r for r in records if r.revision < after.revision]
        before = older[-1] if older else None
    else:
        before = by_rev.get(from_rev)
        if before is None:
            raise revision_not_found(name, from_rev)
    changes = diff_contracts(before.contract if before else None, after.contract)
    return web.json_response(
        {
            "name": name,
            "from": before.revision if before else None,
            "to": after.revision,
            "changes": msgspec.to_builtins(changes),
            "fingerprints": {
                "from": before.fingerprints if before else {},
                "to": after.fingerprints,
            },
        }
    )


async def delete(request: Request) -> Response:
    name = request.path_params["name"]
    expected = revision_param(request, "expected_revision")
    s = store_of(request)
    cur = await s.current(name)
    if cur is None:
        raise not_found(name)
    if expected is not None and expected != cur[0].revision:
        return conflict(
            name,
            cur[0].revision,
            f"Route '{name}' is at revision {cur[0].revision}, not {expected}.",
        )
    try:
        await s.delete(name, cur[0], cur[1])
    except APIError as exc:
        if exc.err_code != _WRONG_LAST_SEQUENCE:
            raise
        now = await s.current(name)
        now_rev = now[0].revision if now else 0
        return conflict(name, now_rev, f"Route '{name}' changed concurrently.")
    return web.json_response({"name": name, "deleted": True, "revision": cur[0].revision})


# (path, method, handler), each mapping NATS failures to 503; the admin app puts
# them behind its credential. Route names may hold '/' (``org/model``): ``path``
# parameters, and the suffixed paths first so they win the match.
ROUTE_CONTRACT_ROUTES: tuple[tuple[str, str, Handler], ...] = tuple(
    (path, method, nats_guarded(handler))
    for path, method, handler in (
        ("/admin/routes", "GET", list_routes),
        ("/admin/routes/{name:path}/history", "GET", history),
        ("/admin/routes/{name:path}/diff", "GET", diff),
        ("/admin/routes/{name:path}", "PUT", apply),
        ("/admin/routes/{name:path}", "GET", show),
        ("/admin/routes/{name:path}", "DELETE", delete),
    )
)


def _parse_apply(raw: bytes) -> tuple[RouteContract, int | None]:
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object (a route contract).")
    expected = body.pop("expected_revision", None)
    if expected is not None and (type(expected) is not int or expected < 0):
        raise BadRequest(
            "expected_revision must be a non-negative integer.", param="expected_revision"
        )
    try:
        # Strict: no str -> number coercion; unknown fields are rejected.
        return check_new(msgspec.convert(body, RouteContract)), expected
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid route contract: {exc}", param=_path_of(exc)) from exc


def _path_of(exc: msgspec.ValidationError) -> str | None:
    text = str(exc)
    at = text.rfind(" - at `$")
    if at >= 0:
        return text[at + 8 : -1].lstrip(".") or None
    # A cross-field rule (``__post_init__``) names its field first: "rollout.canary.candidate: ..."
    named = _NAMED_FIELD.match(text)
    return named.group(1) if named else None


def revision_param(request: Request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    try:
        rev = int(value)
    except ValueError:
        raise BadRequest(f"'{name}' must be a revision number.", param=name) from None
    if rev < 0:
        raise BadRequest(f"'{name}' must be a revision number.", param=name)
    return rev


def not_found(name: str) -> GatewayError:
    return NotFound(f"No route '{name}'.", code="route_not_found", param="name")


def revision_not_found(name: str, rev: int | None) -> GatewayError:
    return NotFound(
        f"Route '{name}' has no revision {rev} in its history.",
        code="revision_not_found",
        param="revision",
    )

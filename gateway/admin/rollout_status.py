"""``GET /admin/routes/{name}/status``: a route's rollout as it stands
(gateway/admin/rollout_analysis.py): the arms' requests and shares since the
revision took effect, the guard's figures over its window against its
thresholds, and the decision with its reason. ``jetserve routes status NAME``
prints it."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import web
from gateway.admin.rollout_analysis import analyse_now
from gateway.admin.route_contracts import Handler, nats_guarded, not_found, store_of
from gateway.tenancy.request_ledger import LedgerReader


async def status(request: Request) -> Response:
    name = request.path_params["name"]
    cur = await store_of(request).current(name)
    if cur is None:
        raise not_found(name)
    record = cur[0]
    reader: LedgerReader = request.app.state.rt.ledger_reader
    analysis = await analyse_now(reader, record)
    body = msgspec.to_builtins(analysis)
    body["rollout"] = msgspec.to_builtins(record.contract.rollout)
    body["rollback"] = msgspec.to_builtins(record.rollback)
    return web.json_response(body)


# Before the contract routes: ``GET {name:path}`` would otherwise take the suffix.
ROLLOUT_STATUS_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("/admin/routes/{name:path}/status", "GET", nats_guarded(status)),
)

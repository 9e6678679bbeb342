"""OpenAI-compatible HTTP routes."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive

from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.inference.dispatch import error_from_frame
from gateway.inference.service import InferenceService
from gateway.inference.sessions import Admitted, Replayed
from gateway.ingress.sse import (
    ClientGone,
    EventStreamResponse,
    client_events,
    ender,
    race_disconnect,
    sse_body,
    wait_disconnect,
)
from gateway.tenancy.request_ledger import LedgerReader
from gateway.web import error_response, json_response, ledger_lines, ledger_window
from streams.ids import is_safe_id
from streams.inference.frames import Event
from streams.wire import ErrorFrame, Op


def gateway_of(request: Request) -> InferenceService:
    gw: InferenceService = request.app.state.gateway
    return gw


async def _first_event(gw: InferenceService, adm: Admitted) -> Event | None:
    """The event that commits a streaming response, or None when the commit
    timer fires first (then keep-alives hold the connection open)."""
    try:
        return await adm.stream.next_event(gw.cfg.heartbeat_timeout_s, gw.cfg.commit_after_s)
    except TimeoutError:
        return None


async def _note_gone(receive: Receive, gone: asyncio.Event) -> None:
    await wait_disconnect(receive)
    gone.set()


async def _serve(request: Request, op: Op) -> Response:
    gw = gateway_of(request)
    try:
        raw = await request.body()
    except ClientDisconnect:
        # Gone while its body arrived: nothing was admitted, nothing to answer
        # (it was an "Exception in ASGI application" traceback, at a client's will).
        return Response(status_code=499)
    # A hang-up while the request is being queued cancels it by id at once: on a
    # loaded bus the queueing can outlast a short answer (dispatch.py).
    gone = asyncio.Event()
    watch = asyncio.ensure_future(_note_gone(request.receive, gone))
    try:
        adm = await gw.admit(op, raw, request.headers, gone=gone)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if isinstance(adm, Replayed):
        headers = {"X-Request-Id": adm.request_id, "Idempotent-Replayed": "true"}
        return json_response(adm.response, adm.status, headers)
    headers = {"X-Request-Id": adm.request_id, "traceparent": adm.stream.req.traceparent}
    try:
        if gone.is_set():
            raise ClientGone
        if not adm.wants_stream or op == "embedding":
            body = await race_disconnect(request.receive, gw.answer(adm))
            return json_response(body, headers=headers)
        first = await race_disconnect(request.receive, _first_event(gw, adm))
        if isinstance(first, ErrorFrame):
            raise error_from_frame(first)
    except ClientGone:
        # Before the response began: no X-Request-Id reached it, so no resume.
        await gw.abandon(adm, may_resume=False)
        return Response(status_code=499)  # nobody reads it; for the access log
    except GatewayError as exc:
        await gw.fail(adm, exc)
        # Accepted, then failed: the id lets the client find it in its ledger.
        response = error_response(exc)
        response.headers["X-Request-Id"] = adm.request_id
        return response
    stream = sse_body(client_events(gw, adm, first))
    return EventStreamResponse(stream, ender(gw, adm), headers, adm.stream.overflowed)


async def resume_stream(request: Request) -> Response:
    """Continue a streaming request after ``Last-Event-ID`` (the id of the last
    event the client got: gateway/inference/event_ids.py), on any replica, from
    the frames capture. Tenant-scoped."""
    gw = gateway_of(request)
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    try:
        last_event_id = int(raw)
    except ValueError:
        raise BadRequest("Last-Event-ID must be an integer.", param="Last-Event-ID") from None
    include_usage = request.query_params.get("include_usage") in ("1", "true")
    if not is_safe_id(request.path_params["request_id"]):
        # Ids are tokens we made; anything else (a subject wildcard) resumes nothing.
        raise NotFound("No such request.", code="stream_not_found")
    session = await gw.resume(
        request.headers.get("authorization"),
        request.path_params["request_id"],
        last_event_id,
        include_usage,
    )
    headers = {"X-Request-Id": session.request_id}
    stream = sse_body(client_events(gw, session, None))
    return EventStreamResponse(stream, ender(gw, session), headers, session.stream.overflowed)


async def chat_completions(request: Request) -> Response:
    return await _serve(request, "chat")


async def completions(request: Request) -> Response:
    return await _serve(request, "completion")


async def embeddings(request: Request) -> Response:
    return await _serve(request, "embedding")


async def list_models(request: Request) -> Response:
    gw = gateway_of(request)
    key = await gw.tenancy.authenticate(request.headers.get("authorization"))
    # What this key may call: a key scoped to some models (a tenant's own LoRA
    # adapters, say) learns nothing of the fleet's other names.
    allowed = key.scopes.models
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "jetserve", "parent": parent}
        for m, parent in gw.models()
        if "*" in allowed or m in allowed
    ]
    return json_response({"object": "list", "data": data})


async def tenant_ledger(request: Request) -> Response:
    """A tenant's own ledger, JSON lines. The key decides the tenant: there is no
    parameter that could name another one."""
    gw = gateway_of(request)
    key = await gw.tenancy.authenticate(request.headers.get("authorization"))
    if "tenant" in request.query_params:
        raise BadRequest("The ledger is scoped to the key's tenant; 'tenant' is not accepted.")
    since, until, limit = ledger_window(request)
    reader: LedgerReader = request.app.state.ledger_reader
    await gw.settlements.flush()  # this replica's answered requests are in it
    return await ledger_lines(reader.query(key.tenant, since, until, limit))


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    checks: dict[str, bool] = await request.app.state.readiness()
    ok = all(checks.values())
    return json_response({"ready": ok, "checks": checks}, 200 if ok else 503)

"""Agent runs over HTTP: the routes of :class:`gateway.runs.service.RunsService`,
and its event stream as SSE.

    POST /v1/runs                             create (model, messages, tools, budget, deadline)
    GET  /v1/runs/{id}                        the run: status, messages, usage, pending approval
    GET  /v1/runs/{id}/events                 SSE, resumable with Last-Event-ID
    POST /v1/runs/{id}/approvals/{call_id}    {"approve": true|false, "reason": "..."}
    POST /v1/runs/{id}/cancel                 cancel the run and all its descendants

Deciding needs a key with the ``approve`` scope that did not create the run
(``RunsService.decide``); a refusal is a 403 in OpenAI error JSON.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import BadRequest, Unavailable
from gateway.ingress.sse import EventStreamResponse
from gateway.runs.service import EventFeed, RunsService
from gateway.runs.views import Ended, Idle, view
from gateway.web import json_response
from streams.agent import TERMINAL


def runs_of(request: Request) -> RunsService:
    runs: RunsService | None = request.app.state.runs
    if runs is None:
        raise Unavailable("Agent runs are not enabled on this gateway.")
    return runs


async def create_run(request: Request) -> Response:
    run, replayed = await runs_of(request).create(await request.body(), request.headers)
    headers = {"X-Run-Id": run.id}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return json_response(view(run), 200 if replayed else 201, headers)


async def get_run(request: Request) -> Response:
    run = await runs_of(request).get(
        request.headers.get("authorization"), request.path_params["run_id"]
    )
    return json_response(view(run))


async def decide_call(request: Request) -> Response:
    out = await runs_of(request).decide(
        request.headers.get("authorization"),
        request.path_params["run_id"],
        request.path_params["call_id"],
        await request.body(),
    )
    return json_response(out, 202)


async def cancel_run(request: Request) -> Response:
    run = await runs_of(request).cancel(
        request.headers.get("authorization"), request.path_params["run_id"]
    )
    out = view(run)
    out["cancel_requested"] = run.status not in TERMINAL
    return json_response(out, 202 if out["cancel_requested"] else 200)


async def run_events(request: Request) -> Response:
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    try:
        last = int(raw)
    except ValueError:
        raise BadRequest("Last-Event-ID must be an integer.", param="Last-Event-ID") from None
    items = await runs_of(request).events(
        request.headers.get("authorization"), request.path_params["run_id"], last
    )

    async def gone(reason: str) -> None:
        # The client left: what following holds goes now, read or not (the
        # stream's own end gives it back too, via sse's aclosing).
        await items.aclose()

    return EventStreamResponse(sse(items), gone, {"X-Run-Id": request.path_params["run_id"]})


async def sse(items: EventFeed) -> AsyncIterator[bytes]:
    """The run's event stream as SSE: each event with its sequence as ``id``
    (what Last-Event-ID resumes from)."""
    # aclosing: a client gone closes this, and so the run's subscription at once.
    async with contextlib.aclosing(items):
        async for item in items:
            if isinstance(item, Idle):
                yield b": keep-alive\n\n"
            elif isinstance(item, Ended):
                yield b": run ended\n\n"
            else:
                yield b"id: %d\nevent: %s\ndata: %s\n\n" % (item.seq, item.kind.encode(), item.data)

"""Starlette pieces shared by the public app and the admin app: JSON bodies,
OpenAI-shaped error responses and handlers, ledger-window query parsing, and the
ledger read streamed as JSON lines."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import msgspec
import nats.errors
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Scope, Send

from gateway.errors import BadRequest, GatewayError, NotFound, Unavailable
from streams.logs import log_event
from streams.request_ledger import LedgerRecord, encode_record

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
MAX_UNIX_S = 1e11  # year ~5138: anything later is not a time, it is a typo or an attack
MAX_LEDGER_LIMIT = 1_000_000


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), status, headers, media_type="application/json")


def error_response(exc: GatewayError) -> Response:
    return json_response(exc.body(), exc.status, exc.headers())


async def refuse(scope: Scope, send: Send, exc: GatewayError) -> None:
    """Answer ``exc`` at the ASGI level, before any app or endpoint has run. A
    WebSocket upgrade gets it as an HTTP response (the ASGI denial response: the
    status and the JSON body) where the server supports that, else the server's
    plain 403; either way the socket is never accepted."""
    prefix = "" if scope["type"] == "http" else "websocket."
    if prefix and "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008, "reason": ""})
        return
    body = exc.json()
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers().items()]
    headers += [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": f"{prefix}http.response.start", "status": exc.status, "headers": headers})
    await send({"type": f"{prefix}http.response.body", "body": body})


def ledger_window(request: Request) -> tuple[float | None, float | None, int | None]:
    def num(name: str, high: float) -> float | None:
        value = request.query_params.get(name)
        if value is None:
            return None
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not 0 <= number <= high:  # also refuses NaN and infinities
            raise BadRequest(f"'{name}' must be a number in [0, {high:g}].", param=name)
        return number

    limit = num("limit", MAX_LEDGER_LIMIT)
    since, until = num("since", MAX_UNIX_S), num("until", MAX_UNIX_S)
    return since, until, int(limit) if limit is not None else None


async def on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    # Every refusal, accepted or not (bad key, bad body, unknown model, budget):
    # the code and the route, never the body.
    log_event(
        log, "http_error", status=exc.status, code=exc.code, method=request.method,
        path=request.url.path, param=exc.param,
    )  # fmt: skip
    return error_response(exc)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFound(f"Unknown path {request.url.path}", code="not_found"))
    err = BadRequest(str(exc.detail), code="method_not_allowed", status=exc.status_code)
    return error_response(err)


LEDGER_LINES_PER_CHUNK = 256


async def ledger_lines(records: AsyncGenerator[LedgerRecord, None]) -> Response:
    """A ledger read as JSON lines, streamed as it is read: built whole, a read of a
    tenant's 200,000 records held 470 MB in the gateway (and a tenant makes records
    at will: every refusal is one). A bus that cannot be read at the start is a 503;
    one lost mid-read aborts the response (its chunked body never ends), never a
    short body that looks whole. The read's consumer goes when the body ends or
    its client leaves."""
    try:
        first = await anext(records, None)
    except (nats.errors.Error, TimeoutError) as exc:
        await records.aclose()
        raise Unavailable("The ledger is unavailable.", code="bus_unavailable") from exc

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is None:
                return
            chunk = [encode_record(first)]
            async for record in records:
                chunk.append(encode_record(record))
                if len(chunk) >= LEDGER_LINES_PER_CHUNK:
                    yield b"\n".join(chunk) + b"\n"
                    chunk = []
            yield b"\n".join(chunk) + b"\n"
        finally:
            # A client that left cancels this body in Starlette's cancel scope, which
            # cancelled the read's cleanup too: its consumer stayed for the server's
            # inactivity bound. Shielded, it is deleted now.
            with anyio.CancelScope(shield=True):
                await records.aclose()

    return StreamingResponse(body(), media_type="application/x-ndjson")

"""WebSocket bridge: the same OpenAI chunks as SSE, several requests per socket.

Client -> server: ``{"type": "request", "id": "c1", "op": "chat", "body": {...}}``,
``{"type": "cancel", "id": "c1"}``. Server -> client:
``{"type": "chunk", "id", "request_id", "event_id", "data"}``,
``{"type": "response", "id", "data"}`` (non-streaming), ``{"type": "done", "id"}``,
``{"type": "error", "id", "status", "error": {...}}``.

Resuming: a chunk's ``event_id`` is the SSE event id the same chunk has over HTTP
(unique and increasing, gateway/inference/event_ids.py), and ``request_id`` is the
gateway's request id (``X-Request-Id``). ``GET /v1/requests/{request_id}/stream``
with ``Last-Event-ID: <event_id>`` replays exactly the chunks after it, on any replica.

Auth (:mod:`gateway.ingress.ws_auth`), decided before the upgrade is accepted: an
``Authorization`` header; for browsers a single-use ticket from
``POST /v1/ws/tickets``, as ``?ticket=`` or in the subprotocol
``jetserve.bearer.<ticket>`` offered with ``jetserve.v1`` (the accept names
``jetserve.v1``); ``?api_key=`` only with ``--ws-allow-query-key``. A refused upgrade
gets an HTTP status (401, 503) and an OpenAI error body, never an open socket.

Limits: a message over ``--ws-max-message-bytes`` (1 MiB) closes the socket with
1009 (the protocol enforces it before the app sees a byte); past
``--ws-max-inflight`` (16) requests in flight, a new one gets an error frame with
status 429 and the socket stays open; ``--ws-idle-timeout`` (300 s) without a frame
and with nothing in flight closes it with 1000. Closing the socket cancels every
request it still has in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any, Literal

import msgspec
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.config import GatewayConfig
from gateway.errors import BadRequest, ClientTooSlow, GatewayError, RateLimited
from gateway.inference.service import InferenceService
from gateway.inference.sessions import Admitted, Replayed
from gateway.ingress.sse import client_events
from gateway.ingress.ws_auth import authenticate_socket
from gateway.web import refuse
from streams.logs import log_event
from streams.tasks import stop_task
from streams.wire import Op

TOO_SLOW = "The client read the stream too slowly; it was ended."
log = logging.getLogger(__name__)


class WsRequest(msgspec.Struct, tag="request"):
    id: str
    body: dict[str, Any]
    op: Op = "chat"
    # This request's own Idempotency-Key (a socket's requests are many: a key in
    # the upgrade's headers would have been every one's, refused as reused).
    idempotency_key: str | None = None


class WsCancel(msgspec.Struct, tag="cancel"):
    id: str


_decoder = msgspec.json.Decoder(WsRequest | WsCancel)
_encoder = msgspec.json.Encoder()
Kind = Literal["chunk", "response", "done", "error"]


class _Connection:
    def __init__(
        self, ws: WebSocket, gw: InferenceService, headers: dict[str, str], tenant: str
    ) -> None:
        self.ws = ws
        self.gw = gw
        self.headers = headers
        self.tenant = tenant
        self.tasks: dict[str, asyncio.Task[None]] = {}
        # Being admitted (a hold, the fair gate, the publish): set when cancelled.
        # Cancelling the task there would leave a hold or a queued copy behind;
        # its admission ends first, and the request is abandoned then.
        self.admitting: dict[str, asyncio.Event] = {}
        self.admitted: dict[str, Admitted] = {}
        self._send_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._last_active = self._loop.time()  # the last frame in, or request finished

    async def send(self, kind: Kind, rid: str, **fields: Any) -> None:
        async with self._send_lock:
            # Text frames: browsers get strings they can JSON.parse directly.
            await self.ws.send_text(_encoder.encode({"type": kind, "id": rid, **fields}).decode())

    async def error(self, rid: str, exc: GatewayError) -> None:
        await self.send("error", rid, status=exc.status, error=exc.body()["error"])

    async def refuse(self, rid: str, exc: GatewayError) -> None:
        """A message the socket refuses (before any request exists): counted,
        logged with the socket's tenant, and answered with an error frame."""
        _refused(self.gw, exc, self.tenant)
        await self.error(rid, exc)

    async def run_request(self, msg: WsRequest) -> None:
        gone = asyncio.Event()
        self.admitting[msg.id] = gone
        headers = self.headers
        if msg.idempotency_key is not None:
            headers = {**headers, "idempotency-key": msg.idempotency_key}
        try:
            adm = await self.gw.admit(msg.op, _encoder.encode(msg.body), headers, gone=gone)
        except GatewayError as exc:
            if not gone.is_set():
                await self.error(msg.id, exc)
            return
        finally:
            self.admitting.pop(msg.id, None)
        if isinstance(adm, Replayed):
            if not gone.is_set():
                await self.send("response", msg.id, data=adm.response)
            return
        if gone.is_set():
            await self.gw.abandon(adm, "client_cancelled")
            return
        self.admitted[msg.id] = adm
        try:
            if not await self._relay_or_overflow(msg, adm):
                # A client too slow to read: its frame buffer overflowed (a send
                # blocked on the socket, holding the send lock). Its request ends
                # now, recorded once; before, nothing read the overflow, and the
                # request stayed unended for as long as the client held the socket.
                await self.gw.abandon(adm, "client_too_slow")
                # Then it is told, if it reads at all (else this waits for the
                # socket's end, which cancels it: the outcome is recorded already).
                await self.error(msg.id, ClientTooSlow(TOO_SLOW))
        except Exception as exc:
            # The socket failed under a send: the client is gone (starlette raises
            # WebSocketDisconnect or OSError for the first failed send, RuntimeError
            # for every send after it, uvicorn RuntimeError for a send after its
            # close), and the request still ends in one recorded outcome (nothing,
            # once it has), cancelled as by the socket's close. Anything else too,
            # then raised: a bug must not leave a request without its outcome.
            await self.gw.abandon(adm, "client_cancelled")
            if not isinstance(exc, WebSocketDisconnect | OSError | RuntimeError):
                raise
        finally:
            self.admitted.pop(msg.id, None)

    async def _relay_or_overflow(self, msg: WsRequest, adm: Admitted) -> bool:
        """:meth:`_relay`, unless the request's frame buffer overflows first
        (False: the relay is stopped, the blocked send with it)."""
        relay = asyncio.ensure_future(self._relay(msg, adm))
        overflow = asyncio.ensure_future(adm.stream.overflowed.wait())
        try:
            await asyncio.wait({relay, overflow}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            overflow.cancel()
            if not relay.done():
                await stop_task(relay)
        if relay.cancelled():
            return False
        relay.result()  # its error, raised
        return True

    async def _relay(self, msg: WsRequest, adm: Admitted) -> None:
        """The answer, as response, chunk, done and error messages."""
        if not adm.wants_stream or msg.op == "embedding":
            try:
                body = await self.gw.answer(adm)
            except GatewayError as exc:
                await self.error(msg.id, exc)
                return
            await self.send("response", msg.id, data=body)
            return
        # Closed on any exit: a send that fails leaves no reader suspended.
        async with contextlib.aclosing(client_events(self.gw, adm, None)) as events:
            async for kind, payload, status, event_id in events:
                if kind == "chunk":
                    await self.send(
                        "chunk", msg.id, request_id=adm.request_id, event_id=event_id, data=payload
                    )
                elif kind == "done":
                    await self.send("done", msg.id)
                elif kind == "error":
                    assert payload is not None
                    await self.send("error", msg.id, status=status, error=payload["error"])

    async def cancel(self, rid: str) -> None:
        gone = self.admitting.get(rid)
        if gone is not None:
            gone.set()  # still being admitted: run_request abandons it after
            return
        task = self.tasks.pop(rid, None)
        adm = self.admitted.pop(rid, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if adm is not None:
            await self.gw.abandon(adm, "client_cancelled")

    async def _receive(self, idle_s: float) -> Message | None:
        """The next message, or None once the socket has been idle ``idle_s``: no
        frame for that long and nothing in flight."""
        while True:
            # With requests in flight the socket is not idle: look again later.
            wait = idle_s if self.tasks else self._last_active + idle_s - self._loop.time()
            if wait <= 0:
                return None
            try:
                async with asyncio.timeout(wait):
                    message = await self.ws.receive()
            except TimeoutError:
                continue
            self._last_active = self._loop.time()
            return message

    async def serve(self, cfg: GatewayConfig) -> None:
        try:
            while True:
                message = await self._receive(cfg.ws_idle_timeout_s)
                if message is None:
                    await self.ws.close(1000, "idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text") or message.get("bytes") or b""
                try:
                    msg = _decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    await self.refuse("", BadRequest(f"Bad message: {exc}"))
                    continue
                except RecursionError:  # the socket and its requests go on
                    await self.refuse("", BadRequest("Bad message: nested too deeply."))
                    continue
                if isinstance(msg, WsCancel):
                    await self.cancel(msg.id)
                    continue
                if msg.id in self.tasks:
                    await self.refuse(msg.id, BadRequest("Request id already in flight."))
                    continue
                if len(self.tasks) >= cfg.ws_max_inflight:
                    # That request only: the socket and the ones in flight go on.
                    limit = cfg.ws_max_inflight
                    await self.refuse(
                        msg.id,
                        RateLimited(
                            f"At most {limit} requests in flight per socket; wait for one "
                            "to finish or open another socket.",
                            code="too_many_inflight",
                        ),
                    )
                    continue
                task = asyncio.create_task(self.run_request(msg))
                self.tasks[msg.id] = task
                task.add_done_callback(functools.partial(self._done, msg.id))
        except WebSocketDisconnect:
            pass
        finally:
            for rid in list(self.tasks):
                await self.cancel(rid)
            if self.tasks:  # still being admitted: each abandons its request after
                await asyncio.wait(list(self.tasks.values()))

    def _done(self, rid: str, task: asyncio.Task[None]) -> None:
        self._last_active = self._loop.time()
        if self.tasks.get(rid) is task:
            del self.tasks[rid]


async def websocket_endpoint(ws: WebSocket) -> None:
    gw: InferenceService = ws.app.state.gateway
    headers = {k.lower(): v for k, v in ws.headers.items()}
    if "idempotency-key" in headers:
        # Every request of the socket would carry it: the second, another body,
        # was refused as the key reused. Before accept (and before a ticket is
        # spent): the upgrade gets the 400.
        exc: GatewayError = BadRequest(
            "Idempotency-Key is per request: send it as 'idempotency_key' in each "
            "request message, not in the WebSocket's upgrade.",
            param="Idempotency-Key",
        )
        _refused(gw, exc, None)
        await refuse(ws.scope, ws.send, exc)
        return
    try:
        auth = await authenticate_socket(ws, gw.cfg.ws_allow_query_key)
    except GatewayError as exc:
        # Before accept: the upgrade is answered with the status and an error body.
        _refused(gw, exc, None)
        await refuse(ws.scope, ws.send, exc)
        return
    headers.pop("sec-websocket-protocol", None)  # may hold a secret; nothing reads it
    headers["authorization"] = auth.authorization
    await ws.accept(subprotocol=auth.subprotocol)
    await _Connection(ws, gw, headers, auth.tenant).serve(gw.cfg)


def _refused(gw: InferenceService, exc: GatewayError, tenant: str | None) -> None:
    gw.metrics.rejected.labels(exc.code).inc()
    log_event(
        log, "refused", request_id=None, tenant=tenant, cls=None, code=exc.code,
        status=exc.status, gateway=gw.cfg.gateway_id, ingress="websocket",
    )  # fmt: skip

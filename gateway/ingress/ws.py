"""WebSocket bridge: the same OpenAI chunks as SSE, several requests per socket.

Client -> server: ``{"type": "request", "id": "c1", "op": "chat", "body": {...}}``,
``{"type": "cancel", "id": "c1"}``. Server -> client: ``{"type": "chunk", "id", "data"}``,
``{"type": "response", "id", "data"}`` (non-streaming), ``{"type": "done", "id"}``,
``{"type": "error", "id", "status", "error": {...}}``. Auth: ``Authorization``
header on the upgrade, or ``?api_key=`` for browsers that cannot set headers.
Closing the socket cancels every request it still has in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any, Literal

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.errors import BadRequest, GatewayError
from gateway.inference.service import InferenceService
from gateway.inference.sessions import Admitted, Replayed
from gateway.ingress.sse import client_events
from streams.wire import Op


class WsRequest(msgspec.Struct, tag="request"):
    id: str
    body: dict[str, Any]
    op: Op = "chat"


class WsCancel(msgspec.Struct, tag="cancel"):
    id: str


_decoder = msgspec.json.Decoder(WsRequest | WsCancel)
_encoder = msgspec.json.Encoder()
Kind = Literal["chunk", "response", "done", "error"]


class _Connection:
    def __init__(self, ws: WebSocket, gw: InferenceService, headers: dict[str, str]) -> None:
        self.ws = ws
        self.gw = gw
        self.headers = headers
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.admitted: dict[str, Admitted] = {}
        self._send_lock = asyncio.Lock()

    async def send(self, kind: Kind, rid: str, **fields: Any) -> None:
        async with self._send_lock:
            # Text frames: browsers get strings they can JSON.parse directly.
            await self.ws.send_text(_encoder.encode({"type": kind, "id": rid, **fields}).decode())

    async def error(self, rid: str, exc: GatewayError) -> None:
        await self.send("error", rid, status=exc.status, error=exc.body()["error"])

    async def run_request(self, msg: WsRequest) -> None:
        try:
            adm = await self.gw.admit(msg.op, _encoder.encode(msg.body), self.headers)
        except GatewayError as exc:
            await self.error(msg.id, exc)
            return
        if isinstance(adm, Replayed):
            await self.send("response", msg.id, data=adm.response)
            return
        self.admitted[msg.id] = adm
        try:
            if not adm.wants_stream or msg.op == "embedding":
                try:
                    result = await self.gw.collect(adm)
                except GatewayError as exc:
                    await self.error(msg.id, exc)
                    return
                body = self.gw.render(adm, result)
                await self.gw.complete(adm, body)
                await self.send("response", msg.id, data=body)
                return
            async for kind, payload, status, _ in client_events(self.gw, adm, None):
                if kind == "chunk":
                    await self.send("chunk", msg.id, data=payload)
                elif kind == "done":
                    await self.send("done", msg.id)
                elif kind == "error":
                    assert payload is not None
                    await self.send("error", msg.id, status=status, error=payload["error"])
        finally:
            self.admitted.pop(msg.id, None)

    async def cancel(self, rid: str) -> None:
        task = self.tasks.pop(rid, None)
        adm = self.admitted.pop(rid, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if adm is not None:
            await self.gw.abandon(adm, "client_cancelled")

    async def serve(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text") or message.get("bytes") or b""
                try:
                    msg = _decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    await self.error("", BadRequest(f"Bad message: {exc}"))
                    continue
                if isinstance(msg, WsCancel):
                    await self.cancel(msg.id)
                    continue
                if msg.id in self.tasks:
                    await self.error(msg.id, BadRequest("Request id already in flight."))
                    continue
                task = asyncio.create_task(self.run_request(msg))
                self.tasks[msg.id] = task
                task.add_done_callback(functools.partial(self._done, msg.id))
        except WebSocketDisconnect:
            pass
        finally:
            for rid in list(self.tasks):
                await self.cancel(rid)

    def _done(self, rid: str, task: asyncio.Task[None]) -> None:
        if self.tasks.get(rid) is task:
            del self.tasks[rid]


async def websocket_endpoint(ws: WebSocket) -> None:
    gw: InferenceService = ws.app.state.gateway
    headers = {k.lower(): v for k, v in ws.headers.items()}
    if "authorization" not in headers and "api_key" in ws.query_params:
        headers["authorization"] = f"Bearer {ws.query_params['api_key']}"
    await ws.accept()  # then close with a reason a browser can read (a 403 handshake has none)
    try:
        await gw.tenancy.authenticate(headers.get("authorization"))
    except GatewayError as exc:
        await ws.close(code=4401 if exc.status == 401 else 4503, reason=exc.message[:120])
        return
    await _Connection(ws, gw, headers).serve()

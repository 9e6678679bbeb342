"""NATS-native ingress: services call jetserve with a NATS request instead of HTTP.

Subjects ``jetserve.api.chat|completions|embeddings`` (a queue group shared by
all gateway replicas). Headers: ``Authorization: Bearer <key>``, optional
``X-Jetserve-Class``, ``X-Jetserve-Timeout``. Body: the OpenAI request JSON.
Non-streaming: the reply is the OpenAI response JSON. Streaming (``"stream":
true``): each OpenAI chunk is published to the subject named in header
``Jetserve-Stream-To``, then the reply carries ``{"done": true, "id": <request id>}``.
Errors: the reply is OpenAI error JSON with header ``Jetserve-Status``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gateway.errors import BadRequest, GatewayError
from gateway.inference.service import InferenceService
from gateway.inference.sessions import Replayed
from gateway.ingress.sse import client_events
from streams.subjects import INGRESS_CHAT, INGRESS_COMPLETIONS, INGRESS_EMBEDDINGS
from streams.wire import Op

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
STREAM_TO = "Jetserve-Stream-To"
STATUS = "Jetserve-Status"
QUEUE_GROUP = "jetserve-gateway"
_OPS: dict[str, Op] = {
    INGRESS_CHAT: "chat",
    INGRESS_COMPLETIONS: "completion",
    INGRESS_EMBEDDINGS: "embedding",
}


class NatsIngress:
    def __init__(self, nc: Client, gw: InferenceService) -> None:
        self._nc = nc
        self._gw = gw
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()  # owned: awaited in stop()

    async def start(self) -> None:
        for subject in _OPS:
            self._subs.append(await self._nc.subscribe(subject, QUEUE_GROUP, cb=self._on_msg))

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=30)

    async def _on_msg(self, msg: Msg) -> None:
        # Callbacks of one subscription run in sequence; serve each in its own task.
        task = asyncio.create_task(self._serve(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, msg: Msg, body: Any, status: int = 200) -> None:
        if msg.reply:
            await self._nc.publish(msg.reply, _encoder.encode(body), headers={STATUS: str(status)})

    async def _serve(self, msg: Msg) -> None:
        headers = {k.lower(): v for k, v in (msg.headers or {}).items()}
        op = _OPS[msg.subject]
        try:
            adm = await self._gw.admit(op, msg.data, headers)
        except GatewayError as exc:
            await self._reply(msg, exc.body(), exc.status)
            return
        if isinstance(adm, Replayed):
            await self._reply(msg, adm.response, adm.status)
            return
        try:
            if not adm.wants_stream or op == "embedding":
                result = await self._gw.collect(adm)
                body = self._gw.render(adm, result)
                await self._gw.complete(adm, body)
                await self._reply(msg, body)
                return
            stream_to = headers.get(STREAM_TO.lower())
            if not stream_to:
                await self._gw.abandon(adm, "no_stream_subject")
                bad = BadRequest(f"Streaming over NATS needs a '{STREAM_TO}' header.")
                await self._reply(msg, bad.body(), bad.status)
                return
            async for kind, payload, status, _ in client_events(self._gw, adm, None):
                if kind == "chunk":
                    await self._nc.publish(stream_to, _encoder.encode(payload))
                elif kind == "error":
                    await self._reply(msg, payload, status)
                    return
                elif kind == "done":
                    await self._reply(msg, {"done": True, "id": adm.request_id})
        except GatewayError as exc:
            await self._gw.fail(adm, exc)
            await self._reply(msg, exc.body(), exc.status)

"""NATS-native ingress: services call jetserve with a NATS request instead of HTTP.

Subjects ``jetserve.api.chat|completions|embeddings`` (a queue group shared by
all gateway replicas). Headers: ``Authorization: Bearer <key>``, optional
``X-Jetserve-Class``, ``X-Jetserve-Timeout``. Body: the OpenAI request JSON.
Non-streaming: the reply is the OpenAI response JSON. Streaming (``"stream":
true``): each OpenAI chunk is published to the subject named in header
``Jetserve-Stream-To``, then the reply carries ``{"done": true, "id": <request id>}``.
Errors: the reply is OpenAI error JSON with header ``Jetserve-Status``.

The reply subject and ``Jetserve-Stream-To`` must be inboxes of the caller's own
tenant (gateway/ingress/nats_targets.py), checked before anything is charged or
queued: a request without such a reply subject is dropped unanswered (there is
nowhere safe to answer), a foreign ``Jetserve-Stream-To`` gets a 403 error reply.
The reply subject is checked against the key's tenant right after the key is
authenticated, before the body is read, so every answer about the request (a
400 quoting what was wrong with the body included) goes to the caller's own
tenant. Only the refusal of the key itself (401 ``invalid_api_key``, or 503
while the key store is down: fixed texts, nothing of the request) is answered
to the tenant inbox named, with no key to check it against.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gateway.errors import (
    AuthenticationFailed,
    BadRequest,
    GatewayError,
    Unavailable,
)
from gateway.inference.openai_types import Parsed
from gateway.inference.service import Gate, InferenceService
from gateway.inference.sessions import Admitted, Replayed
from gateway.ingress.nats_targets import NotOwnInbox, check_target, inbox_tenant
from gateway.ingress.nats_tasks import PENDING_BYTES, PENDING_MSGS, IngressTasks, Known
from gateway.ingress.sse import client_events
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.tenant_slots import TenantSlots
from streams.logs import log_event
from streams.subjects import INGRESS_CHAT, INGRESS_COMPLETIONS, INGRESS_EMBEDDINGS
from streams.tasks import stop_task
from streams.wire import Op

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
STREAM_TO = "Jetserve-Stream-To"
STATUS = "Jetserve-Status"
QUEUE_GROUP = "jetserve-gateway"
# Outcomes of requests this ingress ends itself.
SHUTDOWN = "gateway_shutting_down"
REPLY_FAILED = "reply_failed"
# After the grace, how long the requests left have to end (abandon, reply).
ENDING_S = 10.0
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
        unknown = gw.metrics.nats_unauthenticated.labels("inference")
        self.work = IngressTasks(gw.cfg.nats_max_unauthenticated, unknown)  # owned: see stop()
        self.slots = TenantSlots(gw.cfg.nats_max_inflight)  # per tenant, authenticated

    async def start(self) -> None:
        for subject in _OPS:
            self._subs.append(
                await self._nc.subscribe(
                    subject,
                    QUEUE_GROUP,
                    cb=self._on_msg,
                    pending_bytes_limit=PENDING_BYTES,
                    pending_msgs_limit=PENDING_MSGS,
                )
            )

    async def stop(self) -> None:
        """No new requests; those in flight have the shutdown grace to end, and
        then end now, each with its one outcome and (its outcome not yet
        decided) an error reply, while the bus is still up (past the grace, the
        connection drained under them: a stream's next publish failed, and it
        ended with no outcome and no reply)."""
        for sub in self._subs:
            await sub.unsubscribe()
        if self.work.tasks:
            await asyncio.wait(self.work.tasks, timeout=self._gw.cfg.shutdown_grace_s)
        left = set(self.work.tasks)
        for task in left:
            task.cancel()  # once: its handler ends the request (abandon, reply)
        if left:
            await asyncio.wait(left, timeout=ENDING_S)
        for task in left:
            await stop_task(task)

    async def _on_msg(self, msg: Msg) -> None:
        # Callbacks of one subscription run in sequence; serve each in its own
        # task (this waits while too many are unauthenticated: nats_tasks.py).
        await self.work.spawn(lambda known: self._serve(msg, known))

    def _dropped(self, msg: Msg, why: str, *, counted: bool = False) -> None:
        if not counted:  # admission counts what it refused
            self._gw.metrics.rejected.labels(NotOwnInbox.code).inc()
        log.warning("nats ingress: dropped a request on %s: %s", msg.subject, why)

    async def _reply(self, msg: Msg, body: Any, status: int = 200) -> None:
        if not msg.reply:
            return
        data = _encoder.encode(body)
        if len(data) > self._nc.max_payload:
            # An answer the bus cannot carry (embeddings as floats are ~4x their
            # packed frames): it went unanswered, the publish's error lost in a
            # task. The caller learns why, and how to ask for less.
            too_big = BadRequest(
                f"The answer is {len(data)} bytes, over the message bus's limit of "
                f"{self._nc.max_payload}: send fewer inputs, or ask for base64.",
                code="response_too_large",
            )
            data, status = _encoder.encode(too_big.body()), too_big.status
        await self._nc.publish(msg.reply, data, headers={STATUS: str(status)})

    async def _serve(self, msg: Msg, known: Known) -> None:
        headers = {k.lower(): v for k, v in (msg.headers or {}).items()}
        op = _OPS[msg.subject]
        if inbox_tenant(msg.reply) is None:
            self._dropped(msg, "reply subject is not a tenant inbox")
            return
        stream_to = headers.get(STREAM_TO.lower())
        shown = _Shown(msg.reply, self.slots.enter, known)
        try:
            await self._admitted_and_served(msg, op, headers, stream_to, shown)
        finally:
            if shown.tenant is not None:
                self.slots.leave(shown.tenant)

    async def _admitted_and_served(
        self, msg: Msg, op: Op, headers: dict[str, str], stream_to: str | None, shown: _Shown
    ) -> None:
        try:
            adm = await self._gw.admit(op, msg.data, headers, _gate(stream_to), caller=shown.check)
        except asyncio.CancelledError:
            # Stopped while admitting (past the grace): told, if it is the caller's
            # own inbox; what admission had held the orphan sweep settles.
            if shown.own:
                ending = _ending()
                with contextlib.suppress(nats.errors.Error):
                    await self._reply(msg, ending.body(), ending.status)
            raise
        except ForeignReply:  # the reply inbox is another tenant's: answer nobody
            self._dropped(msg, "reply subject is another tenant's inbox", counted=True)
            return
        except GatewayError as exc:
            if not shown.own and not _refuses_the_key(exc):
                # Cannot be (the key is checked first), and never answered if it were.
                self._dropped(msg, f"{exc.code} before the caller was known", counted=True)
                return
            await self._reply(msg, exc.body(), exc.status)
            return
        if isinstance(adm, Replayed):
            await self._reply(msg, adm.response, adm.status)
            return
        try:
            await self._answer(msg, op, adm, stream_to)
        except asyncio.CancelledError:
            # The gateway stops and its grace is over (stop()): the request ends
            # now, cancelled upstream and recorded, and its caller is told. One
            # that had its outcome already (its books being written) keeps it:
            # its reply may be lost; a retry under an Idempotency-Key replays it.
            if adm.outcome is None:
                ending = _ending()
                await self._gw.abandon(adm, SHUTDOWN, may_resume=False, status=ending.status)
                with contextlib.suppress(nats.errors.Error):
                    await self._reply(msg, ending.body(), ending.status)
            raise
        except Exception as exc:
            # A send the bus refused (a reconnect's buffer full, a closed or
            # draining connection, a chunk over its max_payload): the caller
            # cannot be told, and the request still ends in one recorded outcome,
            # cancelled upstream. Anything else too, then raised: a bug must not
            # leave a request without its outcome.
            await self._gw.abandon(adm, REPLY_FAILED, may_resume=False)
            if not isinstance(exc, nats.errors.Error | OSError):
                raise
            log_event(
                log, "reply_failed", logging.WARNING, request_id=adm.request_id,
                tenant=adm.stream.req.tenant, cls=adm.stream.req.cls, error=type(exc).__name__,
            )  # fmt: skip

    async def _answer(self, msg: Msg, op: Op, adm: Admitted, stream_to: str | None) -> None:
        """The answer, or its error, to the caller's inboxes."""
        try:
            if not adm.wants_stream or op == "embedding":
                body = await self._gw.answer(adm, self._nc.max_payload)
                await self._reply(msg, body)
                return
            assert stream_to is not None  # the gate refused a stream without one
            events = client_events(self._gw, adm, None)
            async with contextlib.aclosing(events):  # closed on any exit
                async for kind, payload, status, _ in events:
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


def _ending() -> Unavailable:
    return Unavailable("The gateway is shutting down; retry.", code=SHUTDOWN)


class ForeignReply(NotOwnInbox):
    """The reply subject is another tenant's inbox: there is no one to answer."""


def _refuses_the_key(exc: GatewayError) -> bool:
    """The key's own refusal: a fixed text, nothing of the request in it."""
    return isinstance(exc, AuthenticationFailed | Unavailable)


class _Shown:
    """Whether the authenticated caller's tenant owns the reply inbox; then the
    request counts against its tenant's requests in flight (``tenant`` set)."""

    def __init__(self, reply: str, enter: Callable[[str], None], known: Known) -> None:
        self._reply = reply
        self._enter = enter
        self._known = known
        self.own = False
        self.tenant: str | None = None

    def check(self, key: KeyRecord) -> None:
        self._known()  # authenticated: no longer counted as unknown (nats_tasks.py)
        if inbox_tenant(self._reply) != key.tenant:
            raise ForeignReply("The reply subject is another tenant's inbox.")
        self.own = True
        self._enter(key.tenant)
        self.tenant = key.tenant


def _gate(stream_to: str | None) -> Gate:
    """The caller's stream target against its key, before admission."""

    def gate(key: KeyRecord, parsed: Parsed) -> None:
        if stream_to is not None:
            check_target(stream_to, key.tenant, f"'{STREAM_TO}'")
        elif getattr(parsed, "stream", False):
            raise BadRequest(f"Streaming over NATS needs a '{STREAM_TO}' header.")

    return gate

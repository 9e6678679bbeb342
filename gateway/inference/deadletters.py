"""Requests past ``max_deliver`` are reported, never dropped silently.

JetStream stops delivering a message after ``max_deliver`` attempts (workers
that crashed or stalled before the first token) and says so in an advisory.
One gateway replica (queue group) takes each advisory: it tells the waiting
client (an error frame on the request's reply subject), keeps the message in
the dead-letter stream with the reason, and removes it from the work queue.
"""

from __future__ import annotations

import logging
import time

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from gateway.metrics import GatewayMetrics
from streams.deadletter import dead_letter
from streams.definitions import Topology
from streams.logs import log_event
from streams.removal import remove_msg
from streams.subjects import live_subject
from streams.wire import ErrorFrame, decode_request, encode

log = logging.getLogger(__name__)
QUEUE_GROUP = "jetserve-deadletters"


class _Advisory(msgspec.Struct):
    stream: str
    consumer: str
    stream_seq: int
    deliveries: int = 0


_advisory = msgspec.json.Decoder(_Advisory)


def advisory_subject(stream: str) -> str:
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*"


class MaxDeliveriesWatch:
    def __init__(
        self, nc: Client, js: JetStreamContext, topo: Topology, metrics: GatewayMetrics
    ) -> None:
        self._nc = nc
        self._js = js
        self._topo = topo
        self._metrics = metrics
        self._subs: list[Subscription] = []
        self.handled = 0

    async def start(self) -> None:
        for stream in self._topo.request_streams:  # one, or one per class
            sub = await self._nc.subscribe(
                advisory_subject(stream), QUEUE_GROUP, cb=self._on_advisory
            )
            self._subs.append(sub)

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            adv = _advisory.decode(msg.data)
        except msgspec.DecodeError:
            log.error("unreadable max-deliveries advisory: %r", msg.data[:200])
            return
        try:
            stored = await self._js.get_msg(adv.stream, adv.stream_seq)
        except (NotFoundError, APIError, nats.errors.Error, TimeoutError):
            return  # acked or removed meanwhile: nothing is stuck
        data = stored.data or b""
        reason = f"max_deliver reached ({adv.deliveries} deliveries, consumer {adv.consumer})"
        try:
            req = decode_request(data)
        except msgspec.DecodeError:
            req = None
        if req is not None:
            expired = time.time() >= req.deadline
            frame = ErrorFrame(
                seq=1,
                code="deadline_exceeded" if expired else "max_deliveries_exceeded",
                message="The request could not be served: every attempt failed before it "
                "produced a token.",
                retryable=True,
                status=504 if expired else 503,
                attempt=adv.deliveries,
            )
            told = encode(frame)
            await self._nc.publish(live_subject(req.reply), told)  # a waiting reader
            await self._nc.publish(req.reply, told)  # the capture (a resume)
        # The request itself, to inspect or replay (it was the error frame above).
        await dead_letter(self._js, stored.subject or "", data, reason, adv.stream_seq)
        log_event(
            log, "dead_lettered", request_id=req.id if req else None,
            tenant=req.tenant if req else None, cls=req.cls if req else None,
            code="max_deliveries_exceeded", deliveries=adv.deliveries, consumer=adv.consumer,
            seq=adv.stream_seq,
        )  # fmt: skip
        try:
            await remove_msg(self._js, adv.stream, adv.stream_seq)
        except (NotFoundError, APIError, nats.errors.Error, TimeoutError) as exc:
            log.warning("could not remove dead-lettered message %s: %s", adv.stream_seq, exc)
        self._metrics.rejected.labels("max_deliveries_exceeded").inc()
        self.handled += 1

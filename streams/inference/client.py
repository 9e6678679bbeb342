"""Publishing inference requests and cancels, and reading the frames capture.

The work queue dedupes on ``Nats-Msg-Id`` (the request id), so a caller that
publishes the same request twice (a retry, an agent step taken over) gets one
execution. Failures come back as streams errors (streams/errors.py); each
caller maps them to its own (the gateway to HTTP errors, the agent to a
retryable model-call failure).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from streams.definitions import Topology
from streams.errors import (
    BusUnavailableError,
    PublishError,
    QueueFullError,
    RequestTooLargeError,
)
from streams.headers import Header
from streams.inference.frames import QueuedAt
from streams.marks import CancelMarks
from streams.removal import remove_msg
from streams.subjects import cancel_subject, frames_filter
from streams.wire import (
    Cancel,
    ErrorFrame,
    Final,
    Frame,
    InferenceRequest,
    Meta,
    Token,
    decode_frames,
    encode,
)

PUBLISH_TIMEOUT_S = 5.0
# JetStream API errors of a full work queue: maximum messages / maximum bytes
# exceeded (discard new).
QUEUE_FULL_CODES = (10077, 10047)
_BUS_ERRORS = (nats.errors.Error, TimeoutError, OSError)


def request_headers(req: InferenceRequest, msg_id: str | None = None) -> dict[str, str]:
    """The publish headers: the dedupe key (the request id unless given), the
    deadline for routing, and the trace context."""
    headers = {
        Header.MSG_ID.value: msg_id or req.id,
        Header.DEADLINE.value: f"{req.deadline:.3f}",
    }
    if req.traceparent:
        headers[Header.TRACEPARENT.value] = req.traceparent
    if req.tracestate:
        headers[Header.TRACESTATE.value] = req.tracestate
    return headers


class InferenceClient:
    def __init__(self, nc: Client, js: JetStreamContext, topology: Topology) -> None:
        self._nc = nc
        self._js = js
        self.topology = topology
        self._marks = CancelMarks(js, topology)

    def encode(self, req: InferenceRequest) -> bytes:
        """The request's payload; RequestTooLargeError past the bus's message size."""
        payload = encode(req)
        if len(payload) > self._nc.max_payload:
            raise RequestTooLargeError(
                f"Request of {len(payload)} bytes exceeds the bus limit of "
                f"{self._nc.max_payload} bytes."
            )
        return payload

    async def announce(self, req: InferenceRequest, meta: Meta) -> None:
        """The Meta frame, first on the reply subject: what the frames capture
        needs to resume the stream from."""
        try:
            await self._nc.publish(req.reply, encode(meta))
        except _BUS_ERRORS as exc:
            raise BusUnavailableError(repr(exc)) from exc

    async def publish(
        self,
        subject: str,
        req: InferenceRequest,
        payload: bytes | None = None,
        msg_id: str | None = None,
    ) -> PubAck:
        """Enqueue one request (``payload``: its encoding, when already made).
        QueueFullError when the work queue is full, RequestTooLargeError past the
        bus's message size, BusUnavailableError when the bus does not answer, else
        PublishError."""
        headers = request_headers(req, msg_id)
        # Measured against the bus's bound here too: too big, nats-py raises
        # MaxPayloadError, a nats.errors.Error, which read as the bus being down
        # (retryable) and a caller retried it to its deadline.
        data = self.encode(req) if payload is None else payload
        try:
            return await self._js.publish(subject, data, headers=headers, timeout=PUBLISH_TIMEOUT_S)
        except nats.errors.MaxPayloadError as exc:
            raise RequestTooLargeError(f"Request of {len(data)} bytes: {exc!r}") from exc
        except APIError as exc:
            text = f"{exc.description}"
            if exc.err_code in QUEUE_FULL_CODES or "maximum messages" in text:
                raise QueueFullError(text) from exc
            raise PublishError(text) from exc
        except _BUS_ERRORS as exc:
            raise BusUnavailableError(repr(exc)) from exc

    async def cancel(
        self, request_id: str, reason: str, *queued: QueuedAt | None, keep_attempt: int = 0
    ) -> bool:
        """Tell the worker to stop (all attempts but ``keep_attempt``). With the
        bus down the worker's deadline ends the work instead. ``queued``: where
        the request's messages were stored (stream, sequence), as their
        publishes' acks said. True when the durable mark was stored."""
        note = encode(Cancel(request_id, reason, keep_attempt))
        # At once for a worker that listens; then the durable mark, then again:
        # a worker subscribes before it reads the mark, so it hears the second
        # publish or reads the mark (streams/marks.py).
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(cancel_subject(request_id), note)
        marked = await self._marks.mark(request_id, note)
        if marked:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(cancel_subject(request_id), note)
        for at in queued:
            if at is None:
                continue
            # Not picked up yet? Then no worker hears the cancel: remove the
            # message itself (a no-op if a worker already holds it).
            with contextlib.suppress(nats.errors.Error, TimeoutError, APIError):
                await remove_msg(self._js, *at)
        return marked

    async def still_queued(self, at: QueuedAt) -> bool | None:
        """Whether the request stored at ``at`` is still in its work queue (no
        worker has acked it: a worker acks at its first token); None when the
        bus cannot say now (an election, a timeout)."""
        try:
            await self._js.get_msg(*at, direct=False)
        except NotFoundError:
            return False
        except (*_BUS_ERRORS, APIError):
            return None
        return True

    async def follow(
        self, tenant: str, request_id: str, cb: Callable[[Msg], Awaitable[None]]
    ) -> Subscription:
        """An ordered consumer on one request's captured frames, from the start.
        Raises the bus's own errors (nats.errors.Error, TimeoutError, APIError)."""
        return await self._js.subscribe(
            frames_filter(tenant, request_id, self.topology.frames_partitions),
            stream=self.topology.frames_stream_of(request_id),
            cb=cb,
            ordered_consumer=True,
        )

    async def _read_capture(
        self,
        tenant: str,
        request_id: str,
        enough: Callable[[Frame], bool],
        wait_s: float,
        held_only: bool = False,
    ) -> None:
        """Hand one request's captured frames, from the start, to ``enough``
        until it says so or ``wait_s`` passes (``held_only``: or the capture
        has no more now; else frames still on their way are waited for)."""
        read = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            with contextlib.suppress(msgspec.DecodeError):
                for frame in decode_frames(msg.data):  # the capture batches tokens
                    if enough(frame):
                        read.set()
            if held_only and not msg.metadata.num_pending:
                read.set()

        try:
            sub = await self.follow(tenant, request_id, on_msg)
        except (nats.errors.Error, TimeoutError, APIError):
            return
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(read.wait(), wait_s)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def captured(self, tenant: str, request_id: str, wait_s: float) -> list[Frame] | None:
        """One request's frames, read back from the frames capture up to its
        terminal frame: a whole answer the live subject dropped. None when the
        capture holds no terminal frame of it (read to its end within ``wait_s``)."""
        frames: list[Frame] = []

        def take(frame: Frame) -> bool:
            frames.append(frame)
            return isinstance(frame, Final | ErrorFrame)

        await self._read_capture(tenant, request_id, take, wait_s, held_only=True)
        ended = any(isinstance(f, Final | ErrorFrame) for f in frames)
        return frames if ended else None

    async def recover(
        self, tenant: str, request_id: str, attempt: int, after: int, through: int, wait_s: float
    ) -> list[Token] | None:
        """Tokens ``after+1 .. through`` of one attempt, read back from the frames
        capture: core NATS delivers at most once, so a server dying between the
        worker and the reader can drop a frame the (replicated) capture kept.
        None when the capture does not hold them all within ``wait_s``."""
        want = set(range(after + 1, through + 1))
        found: dict[int, Token] = {}

        def take(frame: Frame) -> bool:
            if isinstance(frame, Token) and frame.attempt == attempt and frame.seq in want:
                found[frame.seq] = frame
            return len(found) == len(want)

        await self._read_capture(tenant, request_id, take, wait_s)
        if len(found) != len(want):
            return None
        return [found[s] for s in sorted(found)]

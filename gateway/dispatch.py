"""Publish requests onto the work queue and receive their frames.

One core-NATS subscription per gateway (``jetserve.reply.<gateway>.*``) fans
frames out to per-request queues. :class:`FrameStream` turns those into the
request's events with the liveness rules of DESIGN.md: before the first token
the request may be redelivered, so only its deadline ends the wait; after it,
silence longer than the heartbeat timeout means the worker is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import APIError

from gateway.errors import (
    GatewayError,
    RateLimited,
    Timeout,
    Unavailable,
    UpstreamFailed,
    from_frame,
)
from streams.definitions import Topology
from streams.headers import Header
from streams.subjects import cancel_subject, reply_subject, reply_wildcard, request_subject
from streams.wire import (
    Cancel,
    ErrorFrame,
    Final,
    Heartbeat,
    InferenceRequest,
    Token,
    decode_frame,
    encode,
)

# Per-request frame buffer. Workers publish at engine speed; a client slower
# than that gets coalesced deltas (the writer drains the queue in one go).
MAX_BUFFERED_FRAMES = 4096


OVERFLOW = b"overflow"  # sentinel in a request's frame queue: the client fell too far behind


class StreamInterrupted(UpstreamFailed):
    code = "stream_interrupted"


class ClientTooSlow(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "client_too_slow"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Dispatcher:
    def __init__(
        self, nc: Client, js: JetStreamContext, gateway_id: str, topology: Topology
    ) -> None:
        self._nc = nc
        self._js = js
        self.gateway_id = gateway_id
        self.topology = topology
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._sub: Subscription | None = None

    def reply_for(self, request_id: str) -> str:
        return reply_subject(self.gateway_id, request_id)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(reply_wildcard(self.gateway_id), cb=self._on_frame)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_frame(self, msg: Msg) -> None:
        queue = self._queues.get(msg.subject.rsplit(".", 1)[-1])
        if queue is None:
            return
        if queue.qsize() < MAX_BUFFERED_FRAMES:
            queue.put_nowait(msg.data)
        elif queue.qsize() == MAX_BUFFERED_FRAMES:
            # Never drop frames silently: the reader sees the overflow and
            # ends the client's stream with a clear error.
            queue.put_nowait(OVERFLOW)

    async def submit(self, req: InferenceRequest) -> FrameStream:
        """Register for frames, then publish; the frames can't arrive before we listen."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._queues[req.id] = queue
        headers = {Header.MSG_ID.value: req.id, Header.DEADLINE.value: f"{req.deadline:.3f}"}
        if req.traceparent:
            headers[Header.TRACEPARENT.value] = req.traceparent
        if req.tracestate:
            headers[Header.TRACESTATE.value] = req.tracestate
        payload = encode(req)
        if len(payload) > self._nc.max_payload:
            self._queues.pop(req.id, None)
            raise RequestTooLarge(
                f"Request of {len(payload)} bytes exceeds the bus limit of "
                f"{self._nc.max_payload} bytes.",
            )
        try:
            ack = await self._js.publish(
                request_subject(req.cls), payload, headers=headers, timeout=5.0
            )
        except APIError as exc:
            self._queues.pop(req.id, None)
            text = exc.description or ""
            # 10077: maximum messages exceeded, 10047: maximum bytes (discard new).
            if exc.err_code in (10077, 10047) or "maximum messages" in text:
                raise RateLimited(
                    "The request queue is full; retry shortly.", code="queue_full", retry_after=1.0
                ) from exc
            raise Unavailable(f"Could not enqueue the request: {exc.description}") from exc
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            self._queues.pop(req.id, None)
            raise Unavailable("The message bus is unavailable.", code="bus_unavailable") from exc
        return FrameStream(self, req, queue, duplicate=bool(ack.duplicate), seq=ack.seq)

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def cancel(self, request_id: str, reason: str, seq: int | None = None) -> None:
        # If the bus is down the worker's deadline ends the work instead.
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(cancel_subject(request_id), encode(Cancel(request_id, reason)))
        if seq is not None:
            # Not picked up yet? Then no worker hears the cancel: remove the
            # message itself (a no-op if a worker already holds it).
            with contextlib.suppress(nats.errors.Error, TimeoutError, APIError):
                await self._js.delete_msg(self.topology.stream, seq)


Event = Token | Final | ErrorFrame


class FrameStream:
    def __init__(
        self,
        dispatcher: Dispatcher,
        req: InferenceRequest,
        queue: asyncio.Queue[bytes],
        *,
        duplicate: bool,
        seq: int | None = None,
    ) -> None:
        self._d = dispatcher
        self.stream_seq = seq  # the request message's sequence in the work queue
        self.req = req
        self._queue = queue
        self.duplicate = duplicate
        self.attempt: int | None = None  # the delivery whose tokens we relay
        self.last_seq = 0
        self.done = False
        self.first_token_at: float | None = None

    @property
    def started(self) -> bool:
        return self.last_seq > 0

    async def _next_raw(self, heartbeat_timeout: float, wait_limit: float | None) -> bytes:
        # Before the first token only the deadline ends the wait (the worker
        # reports expiry itself; +0.5 s lets its frame win).
        timeout = heartbeat_timeout if self.started else self.req.deadline - time.time() + 0.5
        if wait_limit is not None:
            timeout = min(timeout, wait_limit)
        try:
            return await asyncio.wait_for(self._queue.get(), max(timeout, 0.0))
        except TimeoutError:
            if wait_limit is not None and timeout == wait_limit:
                raise
            if self.started:
                raise StreamInterrupted(
                    "The worker serving this request stopped responding mid-stream."
                ) from None
            raise Timeout("The request did not complete before its deadline.") from None

    async def next_event(self, heartbeat_timeout: float, wait_limit: float | None = None) -> Event:
        """The next token, final or error frame. Raises TimeoutError only when
        ``wait_limit`` (a caller's keep-alive tick) expires first."""
        while True:
            raw = await self._next_raw(heartbeat_timeout, wait_limit)
            if raw == OVERFLOW:
                await self.cancel("client_too_slow")
                raise ClientTooSlow("The client read the stream too slowly; it was ended.")
            frame = decode_frame(raw)
            if self.attempt is not None and frame.attempt != self.attempt:
                continue  # a redelivered attempt racing the one we relay
            if isinstance(frame, Heartbeat):
                continue
            if isinstance(frame, Token):
                if frame.seq <= self.last_seq:
                    continue
                if self.attempt is None:
                    self.attempt = frame.attempt
                    self.first_token_at = time.monotonic()
                self.last_seq = frame.seq
                return frame
            self.done = True
            return frame

    def drain_tokens(self) -> list[Token]:
        """Tokens already buffered (for coalescing into one client write)."""
        out: list[Token] = []
        while not self._queue.empty():
            raw = self._queue.get_nowait()
            if raw == OVERFLOW:
                self._queue.put_nowait(raw)  # next_event reports it
                break
            frame = decode_frame(raw)
            if (
                isinstance(frame, Token)
                and frame.seq > self.last_seq
                and (self.attempt is None or frame.attempt == self.attempt)
            ):
                self.last_seq = frame.seq
                out.append(frame)
            elif isinstance(frame, Final | ErrorFrame):
                # Put the terminal frame back for next_event.
                self._queue.put_nowait(encode(frame))
                break
        return out

    async def events(self, heartbeat_timeout: float) -> AsyncIterator[Event]:
        while not self.done:
            yield await self.next_event(heartbeat_timeout)

    async def cancel(self, reason: str = "client_disconnected") -> None:
        if not self.done:
            self.done = True
            await self._d.cancel(self.req.id, reason, None if self.started else self.stream_seq)

    def close(self) -> None:
        self._d.forget(self.req.id)


def error_from_frame(frame: ErrorFrame) -> GatewayError:
    return from_frame(frame.status, frame.code, frame.message)

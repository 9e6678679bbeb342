"""Publish requests onto the work queue and receive their frames.

One core-NATS subscription per gateway (``jetserve.reply.*.<gateway>.*``) fans
frames out to per-request queues. :class:`FrameStream` turns those into the
request's events with the liveness rules of DESIGN.md: before the first token
the request may be redelivered, so only its deadline ends the wait; after it,
silence longer than the heartbeat timeout means the worker is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext
from nats.js.errors import APIError

from gateway.errors import (
    GatewayError,
    RateLimited,
    Timeout,
    Unavailable,
    UpstreamFailed,
    from_frame,
)
from gateway.inference.hedging import Hedger
from streams.deadletter import dead_letter
from streams.definitions import Topology
from streams.headers import Header
from streams.routes import HedgePolicy
from streams.subjects import (
    cancel_subject,
    frames_filter,
    reply_subject,
    reply_wildcard,
    request_subject,
    resumed_subject,
)
from streams.wire import (
    HEDGE_ATTEMPT_BASE,
    Cancel,
    ErrorFrame,
    Final,
    Frame,
    Heartbeat,
    InferenceRequest,
    Meta,
    Token,
    decode_frame,
    encode,
)

# How long a gateway waits for the frames capture to hand back tokens that core
# NATS lost on their way here (a server died between worker and gateway).
GAP_RECOVERY_S = 3.0

# Per-request frame buffer. Workers publish at engine speed; a client slower
# than that gets coalesced deltas (the writer drains the queue in one go).
MAX_BUFFERED_FRAMES = 1024


class _Overflow:
    """Sentinel in a request's frame queue: the client fell too far behind."""


OVERFLOW = _Overflow()
Item = Frame | _Overflow


class FrameBuffer(asyncio.Queue[Item]):
    """One request's frames, bounded. ``overflowed`` is set the moment the bound
    is hit, so the response can end at once even while a write is blocked on a
    client that stopped reading."""

    def __init__(self) -> None:
        super().__init__()
        self.overflowed = asyncio.Event()


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
        self,
        nc: Client,
        js: JetStreamContext,
        gateway_id: str,
        topology: Topology,
        max_buffered_frames: int = MAX_BUFFERED_FRAMES,
        gap_recovery_s: float = GAP_RECOVERY_S,
    ) -> None:
        self.max_buffered = max_buffered_frames
        self.gap_recovery_s = gap_recovery_s
        self._nc = nc
        self._js = js
        self.gateway_id = gateway_id
        self.topology = topology
        self._queues: dict[str, FrameBuffer] = {}
        self._sub: Subscription | None = None
        self._closing: set[asyncio.Task[object]] = set()  # owned: awaited in stop()
        self._watches: dict[str, Subscription] = {}
        self.hedger = Hedger()
        # Counts hedges (sent, won, lost, capped, failed); the gateway sets its metric.
        self.on_hedge: Callable[[str, str], None] = lambda cls, outcome: None

    def reply_for(self, tenant: str, request_id: str) -> str:
        return reply_subject(tenant, self.gateway_id, request_id)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(reply_wildcard(self.gateway_id), cb=self._on_frame)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        if self._closing:
            await asyncio.wait(self._closing, timeout=5)

    async def watch_resumed(self, request_id: str) -> asyncio.Event:
        """An event set when any replica announces a resume of this request."""
        event = asyncio.Event()

        async def on_msg(_: Msg) -> None:
            event.set()

        self._watches[request_id] = await self._nc.subscribe(resumed_subject(request_id), cb=on_msg)
        return event

    async def unwatch_resumed(self, request_id: str) -> None:
        sub = self._watches.pop(request_id, None)
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def defer_unsubscribe(self, sub: Subscription) -> None:
        """Unsubscribe a resumed stream's consumer from sync code (a stream's close)."""

        async def unsubscribe() -> None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

        self._own(unsubscribe())

    async def _on_frame(self, msg: Msg) -> None:
        request_id = msg.subject.rsplit(".", 1)[-1]
        queue = self._queues.get(request_id)
        if queue is not None:
            self._enqueue(queue, msg, request_id)

    def _enqueue(self, queue: FrameBuffer, msg: Msg, request_id: str) -> None:
        """Decode once, here; a malformed frame is dead-lettered, not fatal."""
        try:
            frame = decode_frame(msg.data)
        except msgspec.DecodeError as exc:
            self._own(dead_letter(self._js, msg.subject, msg.data, f"undecodable frame: {exc}"))
            return
        if queue.qsize() < self.max_buffered:
            queue.put_nowait(frame)
        elif not queue.overflowed.is_set():
            # Never drop frames silently: the reader sees the overflow and ends
            # the client's stream with a clear error; the engine stops now.
            queue.put_nowait(OVERFLOW)
            queue.overflowed.set()
            self._own(self.cancel(request_id, "client_too_slow"))

    def _own(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run a background chore this dispatcher owns (awaited in stop())."""
        task = asyncio.ensure_future(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def submit(
        self,
        req: InferenceRequest,
        meta: Meta,
        subject: str | None = None,
        hedge: HedgePolicy | None = None,
    ) -> FrameStream:
        """Register for frames, then publish; the frames can't arrive before we listen.
        The Meta frame goes first, so the frames capture can be resumed from.
        ``subject``: a lane (prefix affinity) instead of the class subject;
        ``hedge``: race a second copy if the first token is late."""
        queue = FrameBuffer()
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
            await self._nc.publish(req.reply, encode(meta))
            ack = await self._js.publish(
                subject or request_subject(req.cls), payload, headers=headers, timeout=5.0
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
        stream = FrameStream(self, req, queue, duplicate=bool(ack.duplicate), seq=ack.seq)
        if hedge is not None and not stream.duplicate:
            self.hedger.admit(req.cls, hedge)
            delay = self.hedger.delay(req.cls, hedge)
            if delay is not None:
                stream.hedge_task = asyncio.create_task(self._hedge_after(stream, delay, headers))
        return stream

    async def _hedge_after(
        self, stream: FrameStream, delay: float, headers: dict[str, str]
    ) -> None:
        """The second copy: to the plain class subject (any worker with room, so
        most likely another replica), numbered apart so its frames are told apart."""
        await asyncio.sleep(delay)
        req = stream.req
        if stream.started or stream.done or time.time() >= req.deadline:
            return
        if not self.hedger.take(req.cls):
            self.on_hedge(req.cls, "capped")
            return
        copy = msgspec.structs.replace(req, attempt_base=HEDGE_ATTEMPT_BASE)
        headers = {**headers, Header.MSG_ID.value: f"{req.id}.hedge"}
        try:
            ack = await self._js.publish(
                request_subject(req.cls), encode(copy), headers=headers, timeout=5.0
            )
        except (APIError, nats.errors.Error, TimeoutError, OSError):
            self.on_hedge(req.cls, "failed")
            return  # the original still runs: a hedge is an extra, never a must
        stream.hedge_seq = ack.seq
        stream.copies = 2
        self.on_hedge(req.cls, "sent")

    async def recover(
        self, tenant: str, request_id: str, attempt: int, after: int, through: int
    ) -> list[Token] | None:
        """Tokens ``after+1 .. through`` of one attempt, read back from the frames
        capture: core NATS delivers at most once, so a server dying between the
        worker and this gateway can drop a frame the (replicated) capture kept.
        None when the capture does not hold them all within the wait."""
        want = set(range(after + 1, through + 1))
        found: dict[int, Token] = {}
        complete = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            with contextlib.suppress(msgspec.DecodeError):
                frame = decode_frame(msg.data)
                if isinstance(frame, Token) and frame.attempt == attempt and frame.seq in want:
                    found[frame.seq] = frame
                    if len(found) == len(want):
                        complete.set()

        try:
            sub = await self._js.subscribe(
                frames_filter(tenant, request_id),
                stream=self.topology.frames_stream,
                cb=on_msg,
                ordered_consumer=True,
            )
        except (nats.errors.Error, TimeoutError, APIError):
            return None
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(complete.wait(), self.gap_recovery_s)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if len(found) != len(want):
            return None
        return [found[s] for s in sorted(found)]

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def resume(self, tenant: str, request_id: str, last_seq: int) -> FrameStream | None:
        """Replay a request's captured frames after ``last_seq``, then follow it live
        (an ordered consumer on the frames stream). None: nothing captured for this
        tenant and id (unknown, expired, or another tenant's)."""
        subject = frames_filter(tenant, request_id)
        try:
            info = await self._js.stream_info(self.topology.frames_stream, subjects_filter=subject)
        except (nats.errors.Error, TimeoutError, APIError) as exc:
            raise Unavailable("The message bus is unavailable.", code="bus_unavailable") from exc
        if not info.state.subjects:
            return None
        queue = FrameBuffer()

        async def on_msg(msg: Msg) -> None:
            self._enqueue(queue, msg, request_id)

        try:
            sub = await self._js.subscribe(
                subject, stream=self.topology.frames_stream, cb=on_msg, ordered_consumer=True
            )
        except (nats.errors.Error, TimeoutError, APIError) as exc:
            raise Unavailable("The message bus is unavailable.", code="bus_unavailable") from exc
        try:
            first = await asyncio.wait_for(queue.get(), 5.0)
        except TimeoutError:
            await sub.unsubscribe()
            return None  # listed a moment ago, expired since
        if not isinstance(first, Meta):
            await sub.unsubscribe()
            return None  # the head of the capture expired: not resumable
        req = InferenceRequest(
            id=request_id,
            op=first.op,
            cls=first.cls,
            model=first.model,
            body={},
            reply="",
            deadline=first.deadline,
            tenant=first.tenant,
            key_id=first.key_id,
            created=first.created,
        )
        stream = FrameStream(self, req, queue, duplicate=False, meta=first, sub=sub)
        stream.skip_through = last_seq
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(resumed_subject(request_id), b"")
        return stream

    async def cancel(
        self, request_id: str, reason: str, *seqs: int | None, keep_attempt: int = 0
    ) -> None:
        # If the bus is down the worker's deadline ends the work instead.
        note = Cancel(request_id, reason, keep_attempt)
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(cancel_subject(request_id), encode(note))
        for seq in seqs:
            if seq is None:
                continue
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
        queue: FrameBuffer,
        *,
        duplicate: bool,
        seq: int | None = None,
        meta: Meta | None = None,
        sub: Subscription | None = None,
    ) -> None:
        self._d = dispatcher
        self.meta = meta
        self._sub = sub  # a resumed stream's own subscription
        self.skip_through = 0  # a resumed stream: tokens the client already has
        self.stream_seq = seq  # the request message's sequence in the work queue
        self.req = req
        self._queue = queue
        self.duplicate = duplicate
        self.attempt: int | None = None  # the delivery whose tokens we relay
        self.last_seq = 0
        self.done = False
        self.first_token_at: float | None = None
        self.submitted_at = time.monotonic()
        # Hedging: the timer that may send a second copy, that copy's queue
        # sequence, and how many copies may still answer before the first token.
        self.hedge_task: asyncio.Task[None] | None = None
        self.hedge_seq: int | None = None
        self.copies = 1
        # Frames to handle before the queue's: recovered tokens, then the frame
        # that revealed the gap.
        self._ahead: deque[Item] = deque()

    @property
    def started(self) -> bool:
        return self.last_seq > 0

    @property
    def overflowed(self) -> asyncio.Event:
        return self._queue.overflowed

    async def _next_raw(self, heartbeat_timeout: float, wait_limit: float | None) -> Item:
        # Before the first token only the deadline ends the wait (the worker
        # reports expiry itself; +0.5 s lets its frame win).
        timeout = heartbeat_timeout if self.started else self.req.deadline - time.time() + 0.5
        if wait_limit is not None:
            timeout = min(timeout, wait_limit)
        if self._ahead:
            return self._ahead.popleft()
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
            frame = await self._next_raw(heartbeat_timeout, wait_limit)
            if isinstance(frame, _Overflow):
                await self.cancel("client_too_slow")
                raise ClientTooSlow("The client read the stream too slowly; it was ended.")
            if isinstance(frame, Meta):
                continue
            if self.attempt is not None and frame.attempt != self.attempt:
                continue  # a redelivered attempt racing the one we relay
            # A heartbeat carries the last token's seq; tokens and finals their own.
            if isinstance(frame, Token | Final | Heartbeat) and frame.seq > self.last_seq + (
                0 if isinstance(frame, Heartbeat) else 1
            ):
                # Tokens before this frame never arrived: fetch them from the
                # capture, or end visibly rather than relay a text with a hole.
                await self._fill_gap(frame)
                continue
            if isinstance(frame, Heartbeat):
                continue
            if isinstance(frame, Token):
                if frame.seq <= self.last_seq:
                    continue
                if frame.seq <= self.skip_through:
                    # Replayed to a resuming client: it has these. Track them so
                    # liveness and attempt locking behave as if relayed.
                    self.attempt = self.attempt or frame.attempt
                    self.last_seq = frame.seq
                    continue
                if self.attempt is None:
                    await self._first_token(frame.attempt)
                self.last_seq = frame.seq
                return frame
            if isinstance(frame, ErrorFrame) and self.attempt is None and self.copies > 1:
                self.copies -= 1  # one copy of a hedged request failed: the other may not
                continue
            self.done = True
            return frame

    async def _first_token(self, attempt: int) -> None:
        self.attempt = attempt
        self.first_token_at = time.monotonic()
        self._d.hedger.observe(self.req.cls, self.first_token_at - self.submitted_at)
        if self.hedge_task is not None:
            self.hedge_task.cancel()
        if self.hedge_seq is not None:
            # A hedge race: the winner keeps going, the loser stops (or, still
            # queued, is removed).
            hedge_won = attempt >= HEDGE_ATTEMPT_BASE
            loser_seq = self.stream_seq if hedge_won else self.hedge_seq
            self._d.on_hedge(self.req.cls, "won" if hedge_won else "lost")
            await self._d.cancel(self.req.id, "hedge_lost", loser_seq, keep_attempt=attempt)

    async def _fill_gap(self, frame: Token | Final | Heartbeat) -> None:
        through = frame.seq if isinstance(frame, Heartbeat) else frame.seq - 1
        if through <= self.skip_through:
            # A resumed stream whose client already has these: nothing to relay.
            self.attempt = self.attempt or frame.attempt
            self.last_seq = through
            self._ahead.appendleft(frame)
            return
        tokens = await self._d.recover(
            self.req.tenant, self.req.id, frame.attempt, self.last_seq, through
        )
        if tokens is None:
            await self.cancel("frames_lost")
            raise StreamInterrupted("Part of this response was lost in transit; it was ended.")
        self._ahead.extendleft([frame, *reversed(tokens)])

    def drain_tokens(self) -> list[Token]:
        """Tokens already buffered and in sequence (coalesced into one client write)."""
        out: list[Token] = []
        while not self._ahead and not self._queue.empty():
            frame = self._queue.get_nowait()
            if isinstance(frame, Token) and self.attempt is not None:
                if frame.attempt != self.attempt or frame.seq <= self.last_seq:
                    continue
                if frame.seq == self.last_seq + 1:
                    self.last_seq = frame.seq
                    out.append(frame)
                    continue
            # Anything else (a gap, a terminal frame, the overflow mark, a
            # heartbeat) is next_event's to judge, in order.
            self._ahead.append(frame)
        return out

    async def events(self, heartbeat_timeout: float) -> AsyncIterator[Event]:
        while not self.done:
            yield await self.next_event(heartbeat_timeout)

    async def cancel(self, reason: str = "client_disconnected") -> None:
        if not self.done:
            self.done = True
            if self.started:
                await self._d.cancel(self.req.id, reason)
            else:
                await self._d.cancel(self.req.id, reason, self.stream_seq, self.hedge_seq)

    def close(self) -> None:
        if self.hedge_task is not None:
            self.hedge_task.cancel()
        self._d.forget(self.req.id)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            self._d.defer_unsubscribe(sub)


def error_from_frame(frame: ErrorFrame) -> GatewayError:
    return from_frame(frame.status, frame.code, frame.message)

"""Publish requests onto the work queue and receive their frames.

One core-NATS subscription per gateway (``jetserve.live.*.<gateway>.*``, the
live twins of its requests' reply subjects) fans frames out to per-request
buffers; the reply subjects themselves are the frames capture's, read back for
a resume (merged with the live frames), gap healing and a settlement nobody
made. :class:`FrameStream` reads one of them under the waiting rule and
de-duplication of streams/inference/frames.py, heals gaps from the frames
capture, settles hedge races, and turns the reader's failures into gateway
errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from gateway.errors import (
    AnswerLost,
    ClientTooSlow,
    GatewayError,
    RateLimited,
    RequestTooLarge,
    ResumeWindowExceeded,
    StreamInterrupted,
    Timeout,
    Unavailable,
    from_frame,
)
from gateway.inference.hedge_budget import SharedHedgeBudget
from gateway.inference.hedging import Hedger
from streams.deadletter import dead_letter
from streams.definitions import Topology
from streams.errors import (
    AnswerLostError,
    BusUnavailableError,
    DeadlineExceededError,
    FramesLostError,
    PublishError,
    QueueFullError,
    ReaderTooSlowError,
    RequestTooLargeError,
    StreamInterruptedError,
)
from streams.inference.client import PUBLISH_TIMEOUT_S, InferenceClient
from streams.inference.frames import (
    MAX_BUFFERED_FRAMES,
    Event,
    FrameBuffer,
    FrameReader,
    InOrder,
    QueuedAt,
)
from streams.routes import HedgePolicy
from streams.subjects import (
    frames_filter,
    live_filter,
    live_subject,
    live_wildcard,
    pool_of,
    pool_subject,
    reply_subject,
    request_subject,
    resumed_subject,
)
from streams.tasks import stop_task
from streams.wire import (
    HEDGE_ATTEMPT_BASE,
    ErrorFrame,
    Frame,
    InferenceRequest,
    Meta,
    Token,
    Tokens,
    decode_captured,
    decode_frames,
    encode,
)

# How long a gateway waits for the frames capture to hand back tokens that core
# NATS lost on their way here (a server died between worker and gateway).
log = logging.getLogger(__name__)
BUS_DOWN = "The message bus is unavailable."

GAP_RECOVERY_S = 3.0
WITHDRAW_RETRY_S = 1.0  # between tries to store an unconfirmed request's cancel


def hedge_subject(subject: str | None, cls: str) -> str:
    """Where a hedge goes: the plain subject of the pool the original went to
    (a routed request stays with its candidates), else of its class."""
    pool = pool_of(subject) if subject else None
    return pool_subject(pool, cls) if pool else request_subject(cls)


def publish_failure(exc: PublishError) -> GatewayError:
    """The gateway error a client sees for a request the bus would not take."""
    if isinstance(exc, QueueFullError):
        return RateLimited(
            "The request queue is full; retry shortly.", code="queue_full", retry_after=1.0
        )
    if isinstance(exc, RequestTooLargeError):
        return RequestTooLarge(exc.message)
    if isinstance(exc, BusUnavailableError):
        return Unavailable(BUS_DOWN, code="bus_unavailable")
    return Unavailable(f"Could not enqueue the request: {exc.message}")


class Dispatcher:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        gateway_id: str,
        topology: Topology,
        max_buffered_frames: int = MAX_BUFFERED_FRAMES,
        gap_recovery_s: float = GAP_RECOVERY_S,
        hedge_budget: SharedHedgeBudget | None = None,
    ) -> None:
        self.max_buffered = max_buffered_frames
        self.gap_recovery_s = gap_recovery_s
        self._nc = nc
        self._js = js
        self.client = InferenceClient(nc, js, topology)
        self.gateway_id = gateway_id
        self.topology = topology
        self._queues: dict[str, FrameBuffer] = {}
        self._sub: Subscription | None = None
        self._closing: set[asyncio.Task[object]] = set()  # owned: awaited in stop()
        # Hedge copies' tasks, by their stream; owned: ended in stop().
        self._hedges: dict[asyncio.Task[None], FrameStream] = {}
        self._watches: dict[str, Subscription] = {}
        self.hedger = Hedger(hedge_budget)
        # Counts hedges (sent, won, lost, capped, failed); the gateway sets its metric.
        self.on_hedge: Callable[[str, str], None] = lambda cls, outcome: None
        # Counts the lost-answer watch's checks (queued, gone, unknown); the
        # gateway sets its metric.
        self.on_queue_check: Callable[[str], None] = lambda result: None
        # Requests whose client left while they were being queued (cancelled by id
        # before the stream acknowledged them); the gateway exports it.
        self.cancelled_while_queueing = 0
        self.unconfirmed_publishes = 0  # refused, and cancelled in case they were stored

    def reply_for(self, tenant: str, request_id: str) -> str:
        return reply_subject(tenant, self.gateway_id, request_id, self.topology.frames_partitions)

    async def start(self) -> None:
        # Live frames only: the reply subject itself is the capture's (batched).
        self._sub = await self._nc.subscribe(
            live_wildcard(self.gateway_id, self.topology.frames_partitions), cb=self._on_frame
        )

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        if self._closing:
            await asyncio.wait(self._closing, timeout=5)
        for chore in list(self._closing):  # e.g. a cancel retried until the bus is back
            await stop_task(chore)
        # No new copy while stopping; one being published is seen through (it may
        # be stored: its cancel by sequence must not be cut off), for at most
        # its publish's timeout and a margin.
        for task, stream in list(self._hedges.items()):
            if not stream.hedge_sending:
                task.cancel()
        if self._hedges:
            await asyncio.wait(set(self._hedges), timeout=PUBLISH_TIMEOUT_S + 1.0)

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

    def defer_unsubscribe(self, subs: tuple[Subscription, ...]) -> None:
        """Unsubscribe a resumed stream's subscriptions from sync code (a stream's close)."""
        self._own(_unsubscribe(subs))

    async def _on_frame(self, msg: Msg) -> None:
        request_id = msg.subject.rsplit(".", 1)[-1]
        queue = self._queues.get(request_id)
        if queue is not None:
            self._enqueue(queue, msg, request_id)

    def _enqueue(self, queue: FrameBuffer | InOrder, msg: Msg, request_id: str) -> None:
        """Decode once, here (a capture message may hold many tokens); a
        malformed frame is dead-lettered, not fatal."""
        try:
            frames = decode_frames(msg.data)
        except msgspec.DecodeError as exc:
            self._own(dead_letter(self._js, msg.subject, msg.data, f"undecodable frame: {exc}"))
            return
        for frame in frames:
            if queue.offer(frame):
                # The client fell a buffer's length behind: its reader ends the
                # stream with a clear error; the engine stops now.
                self._own(self.cancel(request_id, "client_too_slow"))
                return

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
        gone: asyncio.Event | None = None,
    ) -> FrameStream:
        """Register for frames, then publish; the frames can't arrive before we listen.
        The Meta frame goes first, so the frames capture can be resumed from.
        ``subject``: a lane (prefix affinity) instead of the class subject;
        ``hedge``: race a second copy if the first token is late; ``gone``: set
        when the client hangs up, which cancels the request by id at once, even
        while its publish waits for the stream's acknowledgement."""
        queue = FrameBuffer(self.max_buffered)
        self._queues[req.id] = queue
        try:
            payload = self.client.encode(req)
            sending = self._send(req, meta, subject or request_subject(req.cls), payload)
            ack = await (sending if gone is None else self._unless_gone(req.id, sending, gone))
        except PublishError as exc:
            self._queues.pop(req.id, None)
            if isinstance(exc, BusUnavailableError):
                # No answer is not "not stored": the acknowledgement may be what was
                # lost. The request is refused, so it must not run (uncharged) if it
                # was stored: it is cancelled by id until the mark holds.
                self._own(self._withdraw(req))
            raise publish_failure(exc) from exc
        # A duplicate's frames go where the first publish said, maybe another
        # gateway: this stream may hear nothing, and is no judge of a lost answer.
        duplicate = bool(ack.duplicate)
        queued = None if duplicate else (ack.stream, ack.seq)
        stream = FrameStream(self, req, queue, duplicate=duplicate, queued=queued)
        if hedge is not None and not stream.duplicate:
            self.hedger.admit(hedge_bank(req), hedge)
            delay = self.hedger.delay(req.cls, hedge)
            if delay is not None:
                task = asyncio.create_task(
                    self._hedge_after(stream, delay, hedge_subject(subject, req.cls))
                )
                stream.hedge_task = task
                self._hedges[task] = stream
                task.add_done_callback(self._forget_hedge)
        return stream

    async def _withdraw(self, req: InferenceRequest) -> None:
        """Cancel a request whose publish went unconfirmed, until its durable
        mark is stored (a worker that pulls it then ends it unrun) or its
        deadline passes (no worker runs it after that)."""
        self.unconfirmed_publishes += 1
        while not await self.client.cancel(req.id, "publish_unconfirmed"):
            if time.time() >= req.deadline:
                log.warning("request %s: publish unconfirmed, cancel not stored", req.id)
                return
            await asyncio.sleep(WITHDRAW_RETRY_S)

    async def _send(
        self, req: InferenceRequest, meta: Meta, subject: str, payload: bytes
    ) -> PubAck:
        await self.client.announce(req, meta)
        return await self.client.publish(subject, req, payload)

    async def _unless_gone(
        self, request_id: str, sending: Coroutine[Any, Any, PubAck], gone: asyncio.Event
    ) -> PubAck:
        """``sending``, and a cancel by id the moment ``gone`` is set before it
        ends. A stream that stores with ``sync: always`` can take seconds to
        acknowledge on a loaded disk, and a worker may pull and serve the whole
        request meanwhile; the cancel marks reach it (or the one that pulls it
        later) without waiting. The publish itself goes on: the books depend on
        knowing whether it was queued."""
        send = asyncio.ensure_future(sending)
        left = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({send, left}, return_when=asyncio.FIRST_COMPLETED)
            if not send.done():
                self.cancelled_while_queueing += 1
                await self.cancel(request_id, "client_disconnected")
            return await send
        except BaseException:
            send.cancel()
            raise
        finally:
            left.cancel()

    def _forget_hedge(self, task: asyncio.Task[None]) -> None:
        self._hedges.pop(task, None)

    async def _hedge_after(self, stream: FrameStream, delay: float, subject: str) -> None:
        """The second copy: to the plain class (or pool) subject (any worker with
        room, so most likely another replica), numbered apart so its frames are
        told apart.

        Until its publish begins, a first token or the end of the stream cancels
        this task. From then on the copy may be stored whatever becomes of the
        task, so it is seen through instead: its sequence is learnt, it is
        counted, and a race that was decided meanwhile (the copy's first token
        can come before its acknowledgement) or a stream that ended is settled
        here, so no stored copy is left running unseen."""
        await asyncio.sleep(delay)
        req = stream.req
        if stream.started or stream.done or time.time() >= req.deadline:
            return
        if not await self.hedger.take(hedge_bank(req)):
            self.on_hedge(req.cls, "capped")
            return
        if stream.attempt is not None or stream.done:
            return  # decided while the budget was asked: the credit goes unused
        copy = msgspec.structs.replace(req, attempt_base=HEDGE_ATTEMPT_BASE)
        stream.hedge_sending = True  # from here to its end this task is not cancelled
        try:
            ack = await self.client.publish(subject, copy, msg_id=f"{req.id}.hedge")
        except PublishError:
            self.on_hedge(req.cls, "failed")
            return  # the original still runs: a hedge is an extra, never a must
        if stream.hedge_queued is None:  # else a hand-over's note came first: newer
            stream.hedge_queued = (ack.stream, ack.seq)
        stream.copies = 2
        self.on_hedge(req.cls, "sent")
        if stream.attempt is not None:
            await stream.decide_race(stream.attempt)
        elif stream.done:
            # Ended before any token (cancelled, failed): nobody reads the copy.
            await self.cancel(req.id, "hedge_unneeded", stream.hedge_queued)

    async def recover(
        self, tenant: str, request_id: str, attempt: int, after: int, through: int
    ) -> list[Token] | None:
        """Lost tokens, from the frames capture (streams/inference/client.py)."""
        return await self.client.recover(
            tenant, request_id, attempt, after, through, self.gap_recovery_s
        )

    async def captured(self, req: InferenceRequest) -> list[Frame] | None:
        """A request's frames from the frames capture, up to its terminal frame
        (None: the capture holds no end of it)."""
        return await self.client.captured(req.tenant, req.id, self.gap_recovery_s)

    async def report_lost(self, req: InferenceRequest) -> None:
        """Tell every other reader of a request (a resumed or attached client, a
        follower on another replica) that its answer was lost, as a worker's
        error frame would: live, and to the capture."""
        frame = encode(
            ErrorFrame(
                seq=1,
                code="answer_lost",
                message="A worker took this request, and its answer was lost in transit "
                "before any of it was sent; retry the request.",
                retryable=True,
                status=502,
            )
        )
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(live_subject(req.reply), frame)
            await self._nc.publish(req.reply, frame)

    async def still_queued(self, at: QueuedAt) -> bool | None:
        """A request's lost-answer check (streams/inference/frames.py), counted."""
        queued = await self.client.still_queued(at)
        self.on_queue_check({True: "queued", False: "gone", None: "unknown"}[queued])
        return queued

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def resume(
        self, tenant: str, request_id: str, last_seq: int, *, follower: bool = False
    ) -> FrameStream | None:
        """Replay a request's captured frames after ``last_seq``, then follow it live
        (an ordered consumer on the frames stream). None: nothing captured for this
        tenant and id (unknown, expired, or another tenant's). ``follower``: for
        coalescing across replicas, a :class:`FollowedStream`, and no resume announced
        (the request's own client is still there)."""
        partitions = self.topology.frames_partitions
        subject = frames_filter(tenant, request_id, partitions)
        # Unbounded: the capture replays what the client missed at once, up to a
        # whole answer (so at most the request's max_tokens frames); a bound
        # ended every resume of more than that many tokens as too slow.
        queue = FrameBuffer(None)
        # The capture (batched, from its head frame) and the live frames (tokens
        # at engine speed, heartbeats), merged in order, each frame once.
        merged = InOrder(queue, meta_first=True)

        async def on_msg(msg: Msg) -> None:
            self._enqueue(merged, msg, request_id)

        try:
            head = await self._capture_head(self.topology.frames_stream_of(request_id), subject)
            if head is None:
                return None
            if not isinstance(head, Meta):
                # The oldest frames go first: this stream's start is gone, so
                # the text after the client's event cannot be told for sure.
                raise ResumeWindowExceeded(
                    f"The stream '{request_id}' is past the resume window: the start of "
                    "its capture is no longer held."
                )
            live = await self._nc.subscribe(live_filter(tenant, request_id, partitions), cb=on_msg)
        except (nats.errors.Error, TimeoutError, APIError) as exc:
            raise Unavailable(BUS_DOWN, code="bus_unavailable") from exc
        try:
            sub = await self.client.follow(tenant, request_id, on_msg)
        except BaseException as exc:
            # The live subscription goes too: left, it fed a buffer nobody read
            # until the process ended, one more at each failed resume.
            await _unsubscribe((live,))
            if isinstance(exc, nats.errors.Error | TimeoutError | APIError):
                raise Unavailable(BUS_DOWN, code="bus_unavailable") from exc
            raise
        subs = (sub, live)
        try:
            first = await asyncio.wait_for(queue.get(), 5.0)
        except TimeoutError:
            await _unsubscribe(subs)
            return None  # held a moment ago, expired since
        if not isinstance(first, Meta):  # cannot be: the merge puts the head first
            await _unsubscribe(subs)
            return None
        kind = FollowedStream if follower else FrameStream
        stream = kind(
            self, _request_of(request_id, first), queue, duplicate=False, meta=first, subs=subs
        )
        stream.skip_through = last_seq
        # Another session's run (a resume, a retry attached to it): giving up on
        # it here ends this reading, not the run another client may still read.
        stream.follows = True
        if not follower:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(resumed_subject(request_id), b"")
        return stream

    async def _capture_head(self, stream: str, subject: str) -> Frame | Tokens | None:
        """The first captured message of one request (None: nothing captured,
        or not decodable)."""
        try:
            head = await self._js.get_msg(stream, seq=1, subject=subject, next=True)
        except NotFoundError:
            return None
        try:
            return decode_captured(head.data or b"")
        except msgspec.DecodeError:
            return None

    async def cancel(
        self, request_id: str, reason: str, *queued: QueuedAt | None, keep_attempt: int = 0
    ) -> None:
        await self.client.cancel(request_id, reason, *queued, keep_attempt=keep_attempt)


async def _unsubscribe(subs: tuple[Subscription, ...]) -> None:
    for sub in subs:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


def _request_of(request_id: str, meta: Meta) -> InferenceRequest:
    """What a resumed stream knows of its request: the captured Meta frame."""
    return InferenceRequest(
        id=request_id,
        op=meta.op,
        cls=meta.cls,
        model=meta.model,
        body={},
        reply="",
        deadline=meta.deadline,
        tenant=meta.tenant,
        key_id=meta.key_id,
        created=meta.created,
    )


class FrameStream(FrameReader):
    """One request's frames on this gateway, with gateway errors."""

    # Why a started stream went quiet, as the client reads it.
    silence_message = "The worker serving this request stopped responding mid-stream."
    # Reads a run another session owns (resumed, attached, followed): never cancels it.
    follows = False

    def __init__(
        self,
        dispatcher: Dispatcher,
        req: InferenceRequest,
        queue: FrameBuffer,
        *,
        duplicate: bool,
        queued: QueuedAt | None = None,
        meta: Meta | None = None,
        subs: tuple[Subscription, ...] = (),
    ) -> None:
        # ``queued``: the request message's stream and sequence in the work queue.
        super().__init__(queue, req.deadline, queued, dispatcher.still_queued)
        self._d = dispatcher
        self.meta = meta
        self._subs = subs  # a resumed stream's own subscriptions
        self.req = req
        self.duplicate = duplicate
        self.submitted_at = time.monotonic()
        # Hedging: the timer that may send a second copy (its queue sequence is
        # ``hedge_queued``; ``copies``, counted by FrameReader, is how many may answer).
        self.hedge_task: asyncio.Task[None] | None = None
        self.hedge_sending = False  # the copy's publish has begun: seen through, not cancelled
        self.on_close: Callable[[], None] | None = None  # called once, at close

    async def next_event(self, heartbeat_timeout: float, wait_limit: float | None = None) -> Event:
        """The next token, final or error frame. Raises TimeoutError only when
        ``wait_limit`` (a caller's keep-alive tick) expires first, else a
        GatewayError when the stream ends without a terminal frame."""
        try:
            return await super().next_event(heartbeat_timeout, wait_limit)
        except ReaderTooSlowError:
            await self.cancel("client_too_slow")
            raise ClientTooSlow("The client read the stream too slowly; it was ended.") from None
        except FramesLostError:
            await self.cancel("frames_lost")
            raise StreamInterrupted(
                "Part of this response was lost in transit; it was ended."
            ) from None
        except AnswerLostError:
            await self.cancel("answer_lost")
            await self._d.report_lost(self.req)
            raise AnswerLost(
                "A worker took this request, and its answer was lost in transit before "
                "any of it was sent; retry the request."
            ) from None
        except StreamInterruptedError:
            # Silent is not dead: a worker starved of CPU or cut off from the bus
            # may still be generating. The client is told it failed, so the
            # engine is told to stop (a dead worker's cancel costs nothing).
            await self.cancel("stream_interrupted")
            raise StreamInterrupted(self.silence_message) from None
        except DeadlineExceededError:
            # Given up on: a request still queued is removed (with no worker for
            # its queue it stayed there for the stream's hour, counted in the
            # depth that admission and scaling read), a running one stopped. In
            # the background: the mark and the removals can take seconds on a
            # sick bus, and the 504 is due now.
            self._d._own(self.cancel("deadline_exceeded"))
            raise Timeout("The request did not complete before its deadline.") from None

    async def last_look(self) -> bool:
        """The live subject can drop what the capture kept (this gateway's
        reconnect, a server dying between worker and gateway): a whole short
        answer, then, is there, not lost."""
        frames = await self._d.captured(self.req)
        for frame in frames or ():
            self._queue.offer(frame)
        return bool(frames)

    async def on_first_token(self, attempt: int) -> None:
        await super().on_first_token(attempt)
        assert self.first_token_at is not None
        self._d.hedger.observe(self.req.cls, self.first_token_at - self.submitted_at)
        self._stop_hedge_timer()
        if self.hedge_queued is not None:
            await self.decide_race(attempt)

    async def decide_race(self, attempt: int) -> None:
        """A hedge race: the winner (whose first token came first) keeps going,
        the loser stops (or, still queued, is removed)."""
        hedge_won = attempt >= HEDGE_ATTEMPT_BASE
        loser = self.queued if hedge_won else self.hedge_queued
        self._d.on_hedge(self.req.cls, "won" if hedge_won else "lost")
        await self._d.cancel(self.req.id, "hedge_lost", loser, keep_attempt=attempt)

    def _stop_hedge_timer(self) -> None:
        """No copy is needed any more; one being published is seen through."""
        if self.hedge_task is not None and not self.hedge_sending:
            self.hedge_task.cancel()

    @property
    def hedged(self) -> bool:
        """Whether a second copy of this request was queued (the books say so)."""
        return self.hedge_queued is not None

    async def hedge_settled(self) -> None:
        """Wait for a copy being seen through (its publish, then the race it may
        settle): the books say whether the request was hedged, which its
        acknowledgement decides."""
        task = self.hedge_task
        if task is not None and self.hedge_sending and not task.done():
            await asyncio.wait({task})

    async def recover(self, attempt: int, after: int, through: int) -> list[Token] | None:
        return await self._d.recover(self.req.tenant, self.req.id, attempt, after, through)

    async def cancel(self, reason: str = "client_disconnected") -> None:
        if not self.done:
            self.done = True
            if self.follows:
                return  # the run's own gateway decides about it (see resume)
            if self.started:
                await self._d.cancel(self.req.id, reason)
            else:
                await self._d.cancel(self.req.id, reason, self.queued, self.hedge_queued)

    def close(self) -> None:
        self._stop_hedge_timer()
        self._d.forget(self.req.id)
        if self._subs:
            subs, self._subs = self._subs, ()
            self._d.defer_unsubscribe(subs)
        if self.on_close is not None:
            closed, self.on_close = self.on_close, None
            closed()


class FollowedStream(FrameStream):
    """Another replica's execution, read from its frames capture (coalescing across
    replicas, gateway/inference/coalesce_fleet.py). Reading it never stops it: the
    registry decides when the last reader anywhere has left. Its first token,
    replayed, says nothing of the class's queue, so the hedger does not learn from it."""

    async def on_first_token(self, attempt: int) -> None:
        await FrameReader.on_first_token(self, attempt)


def hedge_bank(req: InferenceRequest) -> str:
    """Whose hedge budget a request earns and spends: its class's, and its route's
    within it. One bank per class let a route with ``max_extra_ratio`` 0.05 spend
    what a route with 0.5 earned in the class: up to every one of its requests
    hedged, against its contract's 5%."""
    return f"{req.cls}/{req.route}" if req.route else req.cls


def error_from_frame(frame: ErrorFrame) -> GatewayError:
    return from_frame(frame.status, frame.code, frame.message)

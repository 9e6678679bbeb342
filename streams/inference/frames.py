"""One request's frames, read as the events its caller acts on.

The waiting rule (the liveness rules of DESIGN.md): before the first token the
request may be queued or redelivered, so only its deadline ends the wait; after
it, silence longer than the heartbeat timeout means the worker is gone.

One exception before the first token: a request no longer in the work queue.
A worker acks at its first token, and a NATS node that dies then can take every
frame of a short answer with it (from the capture, its stream electing a
leader, and from the live subject); nothing would ever answer, and the reader
would wait out the deadline. A reader given ``still_queued`` checks it after
each heartbeat timeout without a frame (less often while the answer is yes:
a deep backlog's waiting requests cost a check each); once the request has been
out of the queue for a whole heartbeat timeout more with still no frame, the
answer is lost (:class:`streams.errors.AnswerLostError`, retryable).

De-duplication: the first token locks the attempt (redelivered or hedged copies
racing it are ignored), and tokens are taken in sequence. A sequence gap is
handed to :meth:`FrameReader.recover` (the gateway reads the frames capture);
if that cannot fill it the stream ends visibly, never as a text with a hole.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from streams.errors import (
    AnswerLostError,
    DeadlineExceededError,
    FramesLostError,
    ReaderTooSlowError,
    StreamInterruptedError,
)
from streams.wire import HEDGE_ATTEMPT_BASE, ErrorFrame, Final, Frame, Heartbeat, Meta, Token

# Per-request frame buffer. Workers publish at engine speed; a reader slower
# than that gets the buffered tokens in one go (FrameReader.drain_tokens).
MAX_BUFFERED_FRAMES = 1024
# Past the deadline the worker reports expiry itself; this lets its frame win.
DEADLINE_GRACE_S = 0.5
# While a request is still queued, its lost-answer checks back off from one
# heartbeat timeout to this many.
MAX_CHECK_HEARTBEATS = 8

# Where a copy of a request is stored in its work queue: (stream, sequence), as
# its publish's acknowledgement said.
QueuedAt = tuple[str, int]
# Whether the message at a QueuedAt is still in its work queue (None: the bus
# cannot say now): InferenceClient.still_queued.
StillQueued = Callable[[QueuedAt], Awaitable[bool | None]]

Event = Token | Final | ErrorFrame


class Overflow:
    """Mark in a frame buffer: its reader fell too far behind."""


OVERFLOW = Overflow()
Item = Frame | Overflow


class FrameBuffer(asyncio.Queue[Item]):
    """One request's frames, bounded (``limit`` None: unbounded). ``overflowed``
    is set the moment the bound is hit, so a response can end at once even
    while a write is blocked on a client that stopped reading."""

    def __init__(self, limit: int | None = MAX_BUFFERED_FRAMES) -> None:
        super().__init__()
        self.limit = limit
        self.overflowed = asyncio.Event()

    def offer(self, frame: Frame) -> bool:
        """Queue a frame. True when this one hit the bound: the caller stops the
        producer. Nothing is dropped silently: the reader meets the mark and fails."""
        if self.overflowed.is_set():
            return False
        if self.limit is None or self.qsize() < self.limit:
            self.put_nowait(frame)
            return False
        self.put_nowait(OVERFLOW)
        self.overflowed.set()
        return True


class InOrder:
    """One request's frames from two sources, the live reply subscription and
    the frames capture, offered to ``out`` once each and in sequence.

    Either source alone can lose frames: core NATS drops what a dying server
    held, and the capture stores nothing while its stream elects a leader (a
    short answer can fall entirely into that window, and then nothing shows a
    gap). Per attempt, a token or final past the next expected seq waits here
    for the other source; a copy of one already passed is dropped; a heartbeat
    passes only once the tokens it vouches for have."""

    def __init__(self, out: FrameBuffer, meta_first: bool = False) -> None:
        self._out = out
        self._next: dict[int, int] = {}  # attempt -> next seq to pass
        self._held: dict[int, dict[int, Frame]] = {}
        self._meta = False
        # A resumed reader starts from the capture's head frame: what the live
        # subject brings before it waits behind it.
        self._before_meta: list[Frame] | None = [] if meta_first else None

    def offer(self, frame: Frame) -> bool:
        """True when a frame passed on hit the buffer's bound (FrameBuffer.offer)."""
        if isinstance(frame, Meta):
            if self._meta:
                return False
            self._meta = True
            hit = self._out.offer(frame)
            early, self._before_meta = self._before_meta or [], None
            for waited in early:
                hit = self.offer(waited) or hit
            return hit
        if self._before_meta is not None:
            self._before_meta.append(frame)
            return False
        nxt = self._next.get(frame.attempt, 1)
        if isinstance(frame, Heartbeat):
            return frame.seq < nxt and self._out.offer(frame)
        if frame.seq < nxt:
            return False  # the other source's copy
        held = self._held.setdefault(frame.attempt, {})
        held[frame.seq] = frame
        hit = False
        while nxt in held:
            hit = self._out.offer(held.pop(nxt)) or hit
            nxt += 1
        self._next[frame.attempt] = nxt
        return hit


class FrameReader:
    """Reads one request's :class:`FrameBuffer` under the waiting rule."""

    def __init__(
        self,
        queue: FrameBuffer,
        deadline: float,
        queued: QueuedAt | None = None,
        still_queued: StillQueued | None = None,
    ) -> None:
        self._queue = queue
        self.deadline = deadline
        # Where the request's copies wait in the work queue: the first, and a
        # hedged second (gateway/inference/hedging.py). A worker that hands a
        # copy on to the next candidate's pool says where it went (a heartbeat's
        # ``moved``).
        self.queued = queued
        self.hedge_queued: QueuedAt | None = None
        # The lost-answer watch (module docstring), with ``queued`` known: when
        # the next check is due (monotonic), its back-off, and whether the last
        # check found every copy gone from the queue.
        self.still_queued = still_queued
        self._check_due: float | None = None
        self._check_every = 0.0
        self._gone: tuple[QueuedAt | None, QueuedAt | None] | None = None  # where it looked
        # The attempt of the last hand-over applied, per copy (first, hedge): a
        # later hop's note may arrive before an earlier one's.
        self._moved_by = [0, 0]
        self.heard_at = time.monotonic()  # when the last frame of any kind came
        self.attempt: int | None = None  # the delivery whose tokens we relay
        self.last_seq = 0
        self.skip_through = 0  # a resumed stream: tokens the reader already has
        self.skipped_finish: str | None = None  # a finish reason on a skipped token
        self.copies = 1  # copies that may still answer before the first token (hedging)
        self.done = False
        self.first_token_at: float | None = None
        # The relayed text, when a caller keeps it (a request with a shadow copy to
        # compare with: gateway/inference/shadow.py); None: not kept.
        self.kept: list[str] | None = None
        # Frames to handle before the queue's: recovered tokens, then the frame
        # that revealed the gap; or frames drain_tokens left for next_event.
        self._ahead: deque[Item] = deque()

    @property
    def started(self) -> bool:
        return self.last_seq > 0

    @property
    def overflowed(self) -> asyncio.Event:
        return self._queue.overflowed

    async def _next_item(self, heartbeat_timeout: float, wait_limit: float | None) -> Item:
        if self.started:
            timeout = heartbeat_timeout
        else:
            timeout = self.deadline - time.time() + DEADLINE_GRACE_S
        if wait_limit is not None:
            timeout = min(timeout, wait_limit)
        if self._ahead:
            return self._ahead.popleft()
        try:
            # Not wait_for: on Python 3.11 it drops a cancel that lands as a frame
            # arrives, and a reader cancelled for a gone client read on to the end.
            async with asyncio.timeout(max(timeout, 0.0)):
                return await self._queue.get()
        except TimeoutError:
            if wait_limit is not None and timeout == wait_limit:
                raise
            if self.started:
                raise StreamInterruptedError(
                    f"no frame for {heartbeat_timeout}s after token {self.last_seq}"
                ) from None
            raise DeadlineExceededError("no answer before the request's deadline") from None

    async def next_event(self, heartbeat_timeout: float, wait_limit: float | None = None) -> Event:
        """The next token, final or error frame. Raises TimeoutError only when
        ``wait_limit`` (a caller's keep-alive tick) expires first; otherwise a
        :class:`streams.errors.ReplyError` when the frames end abnormally."""
        until = None if wait_limit is None else time.monotonic() + wait_limit
        while True:
            limit, checking = self._wait(heartbeat_timeout, until)
            try:
                item = await self._next_item(heartbeat_timeout, limit)
            except TimeoutError:
                if not checking:
                    raise
                await self._check_queued(heartbeat_timeout)
                continue
            self.heard_at = time.monotonic()
            self._check_due = None  # heard: silence counts from here
            self._gone = None
            if isinstance(item, Overflow):
                raise ReaderTooSlowError("the reader fell a buffer's length behind")
            event = await self._accept(item)
            if event is not None:
                return event

    def _wait(self, heartbeat_timeout: float, until: float | None) -> tuple[float | None, bool]:
        """How long to wait for the next item, and whether that wait ends at a
        lost-answer check (rather than at the caller's ``until``)."""
        now = time.monotonic()
        caller = None if until is None else max(until - now, 0.0)
        if self.started or self.still_queued is None or self.queued is None:
            return caller, False
        if self._check_due is None:
            self._check_every = heartbeat_timeout
            self._check_due = now + heartbeat_timeout
        check = max(self._check_due - now, 0.0)
        if caller is not None and caller <= check:
            return caller, False
        return check, True

    async def _check_queued(self, heartbeat_timeout: float) -> None:
        """A lost-answer check, due: raises AnswerLostError when the request was
        already seen gone from the queue a heartbeat timeout ago, no frame since
        (and no copy sent or moved since: then it looks again)."""
        where = (self.queued, self.hedge_queued)
        if self._gone == where:
            if await self.last_look():
                self._gone = None
                self._check_due = None
                return
            raise AnswerLostError("a worker took the request, and its answer was lost")
        queued = await self._any_queued()
        # Gone: once more after one heartbeat timeout (the ack that took it off
        # the queue may have come just before this check, its first token still
        # on the way). Unknown: again after one. Queued: back off.
        self._gone = where if queued is False else None
        if queued:
            self._check_every = min(self._check_every * 2, heartbeat_timeout * MAX_CHECK_HEARTBEATS)
        else:
            self._check_every = heartbeat_timeout
        self._check_due = time.monotonic() + self._check_every

    async def last_look(self) -> bool:
        """Before an answer counts as lost: its frames, found elsewhere and queued
        for this reader (the gateway reads the frames capture); False: none."""
        return False

    async def _any_queued(self) -> bool | None:
        """Whether a copy of the request is still queued."""
        assert self.still_queued is not None
        seen = [await self.still_queued(at) for at in (self.queued, self.hedge_queued) if at]
        if True in seen:
            return True
        return None if None in seen else False

    async def _accept(self, frame: Frame) -> Event | None:
        """The frame as an event for the caller, or None: nothing to relay."""
        if isinstance(frame, Meta):
            return None
        if self.attempt is not None and frame.attempt != self.attempt:
            return None  # a redelivered or hedged attempt racing the one we relay
        if isinstance(frame, Heartbeat) and frame.moved and not self.started:
            # Handed on to the next candidate's pool: the copy waits there now
            # (unless a later hop's note came first: attempts grow along the way).
            copy = int(frame.attempt >= HEDGE_ATTEMPT_BASE)
            if frame.attempt > self._moved_by[copy]:
                self._moved_by[copy] = frame.attempt
                moved = (frame.moved[0], frame.moved[1])
                if copy:
                    self.hedge_queued = moved
                else:
                    self.queued = moved
        # A heartbeat carries the last token's seq; tokens and finals their own.
        ahead = 0 if isinstance(frame, Heartbeat) else 1
        if isinstance(frame, Token | Final | Heartbeat) and frame.seq > self.last_seq + ahead:
            await self._fill_gap(frame)
            return None
        if isinstance(frame, Heartbeat):
            return None
        if isinstance(frame, Token):
            if frame.seq <= self.last_seq:
                return None
            if frame.seq <= self.skip_through:
                # Replayed to a resuming reader: it has these. Track them so
                # liveness and attempt locking behave as if relayed.
                self.attempt = self.attempt or frame.attempt
                self.last_seq = frame.seq
                self.skipped_finish = frame.finish_reason or self.skipped_finish
                return None
            if self.attempt is None:
                await self.on_first_token(frame.attempt)
            self.last_seq = frame.seq
            if self.kept is not None:
                self.kept.append(frame.text)
            return frame
        if isinstance(frame, ErrorFrame) and self.attempt is None and self.copies > 1:
            self.copies -= 1  # one copy of a hedged request failed: the other may not
            return None
        self.done = True
        return frame

    async def _fill_gap(self, frame: Token | Final | Heartbeat) -> None:
        through = frame.seq if isinstance(frame, Heartbeat) else frame.seq - 1
        if through <= self.skip_through:
            # A resumed stream whose reader already has these: nothing to relay.
            self.attempt = self.attempt or frame.attempt
            self.last_seq = through
            self._ahead.appendleft(frame)
            return
        tokens = await self.recover(frame.attempt, self.last_seq, through)
        if tokens is None:
            raise FramesLostError(f"tokens {self.last_seq + 1}..{through} were lost in transit")
        self._ahead.extendleft([frame, *reversed(tokens)])

    async def recover(self, attempt: int, after: int, through: int) -> list[Token] | None:
        """Tokens ``after+1 .. through`` of ``attempt`` that never arrived, from
        elsewhere (the frames capture); None: they are lost."""
        return None

    async def on_first_token(self, attempt: int) -> None:
        self.attempt = attempt
        self.first_token_at = time.monotonic()

    def drain_tokens(self) -> list[Token]:
        """Tokens already buffered and in sequence (coalesced into one write)."""
        out: list[Token] = []
        while not self._ahead and not self._queue.empty():
            frame = self._queue.get_nowait()
            if isinstance(frame, Token) and self.attempt is not None:
                if frame.attempt != self.attempt or frame.seq <= self.last_seq:
                    continue
                if frame.seq == self.last_seq + 1:
                    self.last_seq = frame.seq
                    out.append(frame)
                    if self.kept is not None:
                        self.kept.append(frame.text)
                    continue
            # Anything else (a gap, a terminal frame, the overflow mark, a
            # heartbeat) is next_event's to judge, in order.
            self._ahead.append(frame)
        return out

    async def events(self, heartbeat_timeout: float) -> AsyncIterator[Event]:
        while not self.done:
            yield await self.next_event(heartbeat_timeout)

"""Frames from a worker for one request: sequence numbers, and heartbeats
whenever the request is quiet, so the receiver can tell a slow engine from a
dead worker.

Two subjects. Every token and heartbeat goes at once to the live twin of the
request's reply subject (core NATS, nothing stored): the reader's latency is
the engine's. The frames capture (a memory stream on the reply subject, for
resume, gap healing and agent model-call recovery) gets what those need in
fewer, larger messages: the tokens of each quarter second in one
:class:`streams.wire.Tokens` (JSON arrays, defaults left out), and the terminal
frame; no heartbeats (only a live reader needs them). A token in a batch
costs its text and a comma, unless it carries more (logprobs, a tool call). Per request it keeps a
message per 0.25 s of streaming instead of one per token: the capture's
bytes per request, and so its window at a given load, scale with the text,
not the token count (docs/reliability.md, "The resume window")."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import nats.errors
from nats.aio.client import Client

from streams.subjects import live_subject
from streams.wire import ErrorFrame, Final, Heartbeat, Token, Tokens, Usage, encode
from workers.errors import ResponseTooLarge

CAPTURE_EVERY_S = 0.25  # the longest a token waits for the capture
CAPTURE_MAX_BYTES = 256 << 10  # a batch is flushed before it grows past this (logprobs)
# Room for a capture batch's envelope around one frame: a frame this far under the
# bus's limit is always captured too.
FRAME_MARGIN = 1 << 10
# An error frame's message at most (an engine's error body may be anything).
MAX_ERROR_CHARS = 4096


class FrameSender:
    def __init__(
        self,
        nc: Client,
        subject: str,
        attempt: int,
        heartbeat_s: float,
        capture_every_s: float = CAPTURE_EVERY_S,
    ) -> None:
        self._nc = nc
        self._capture = subject  # the reply subject: the frames capture keeps it
        self._live = live_subject(subject)
        self._attempt = attempt
        self._heartbeat_s = heartbeat_s
        self._every = capture_every_s
        self._last_sent = time.monotonic()
        self._batch: list[Token] = []  # tokens sent live, not yet captured
        self._batch_at = 0.0
        self._batch_bytes = 0
        self.seq = 0  # seq of the last token sent
        self.closed = False
        self.outcome = ""  # the finish reason or error code of the terminal frame
        # When the terminal frame went out (epoch ns): where the attempt's span
        # ends, inside the gateway's request span, whatever cleanup follows.
        self.ended_ns: int | None = None

    @property
    def started(self) -> bool:
        return self.seq > 0

    async def token(
        self,
        text: str,
        tool_calls: list[dict[str, Any]] | None = None,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
        reasoning: str | None = None,
    ) -> None:
        frame = Token(
            self.seq + 1, text, tool_calls, finish_reason, self._attempt, logprobs, index, reasoning
        )
        data = encode(frame)
        if len(data) > self._nc.max_payload - FRAME_MARGIN:
            # Before it is sent: the caller fails the request in one error frame.
            # Published, the bus refused it, and the request was redelivered (and
            # run again on the engine) until its deadline, with no answer.
            raise ResponseTooLarge(
                f"One chunk of the answer is {len(data)} bytes (its text, tool calls "
                f"and logprobs), over the message bus's limit of {self._nc.max_payload}: "
                "ask for fewer logprobs or a shorter echo."
            )
        self.seq += 1
        now = self._last_sent = time.monotonic()
        await self._nc.publish(self._live, data)
        if self._batch and self._batch_bytes + len(data) > CAPTURE_MAX_BYTES:
            await self._flush()  # a batch stays under the bus's limit whatever its frames
        if not self._batch:
            self._batch_at = now
        self._batch.append(frame)
        self._batch_bytes += len(data)
        if now - self._batch_at >= self._every or self._batch_bytes >= CAPTURE_MAX_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        """The tokens not captured yet, in one message of the capture."""
        if self._batch:
            batch, self._batch, self._batch_bytes = self._batch, [], 0
            await self._nc.publish(self._capture, encode(Tokens.of(batch)))

    async def _terminal(self, data: bytes) -> None:
        await self._flush()
        self._last_sent = time.monotonic()
        self.ended_ns = time.time_ns()  # before anyone can have read the frame
        await self._nc.publish(self._live, data)
        await self._nc.publish(self._capture, data)

    async def final(self, **fields: Any) -> None:
        usage = fields.pop("usage", Usage())
        data = encode(Final(seq=self.seq + 1, usage=usage, attempt=self._attempt, **fields))
        if len(data) > self._nc.max_payload:
            # Before anything is sent or acked: the caller fails the request
            # (an error frame, the message ended), it is not lost.
            raise ResponseTooLarge(
                f"The answer is {len(data)} bytes, over the message bus's limit of "
                f"{self._nc.max_payload}; send fewer inputs per request."
            )
        self.closed = True
        self.outcome = str(fields.get("finish_reason", "stop"))
        await self._terminal(data)

    async def error(self, code: str, message: str, *, status: int, retryable: bool) -> None:
        self.closed = True
        self.outcome = code
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + " [truncated]"
        await self._terminal(
            encode(ErrorFrame(self.seq + 1, code, message, retryable, status, self._attempt))
        )

    async def moved(self, stream: str, seq: int) -> None:
        """This attempt failed before its first token and the request was handed
        on (stored at ``stream``/``seq``): a heartbeat that says where, so a
        reader watching the queue for a lost answer follows it there."""
        note = Heartbeat(self.seq, time.time(), self._attempt, (stream, seq))
        # Without it a reader checks the old place and, the request gone from
        # there, may count its answer lost: the client retries, nothing is lost.
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(self._live, encode(note))

    async def heartbeats(self) -> None:
        """Run until cancelled: a heartbeat whenever nothing went out for a beat,
        and the capture's batch once it is old (the engine went quiet: a batch
        waits at most ``heartbeat_s / 2`` more)."""
        while not self.closed:
            await asyncio.sleep(self._heartbeat_s / 2)
            if self.closed:
                return
            # One failed publish (a reconnect's full buffer) must not end the
            # heartbeats: the reader would take a live request for a dead one.
            with contextlib.suppress(nats.errors.Error):
                await self._beat()

    async def _beat(self) -> None:
        """One tick: the capture's old batch, and a heartbeat if nothing went out."""
        now = time.monotonic()
        if self._batch and now - self._batch_at >= self._every:
            await self._flush()
        if not self.closed and now - self._last_sent >= self._heartbeat_s:
            self._last_sent = now
            beat = Heartbeat(self.seq, time.time(), self._attempt)
            await self._nc.publish(self._live, encode(beat))

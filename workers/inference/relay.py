"""Frames from a worker to the reply subject of one request: sequence numbers,
and heartbeats whenever the request is quiet, so the receiver can tell a slow
engine from a dead worker."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client

from streams.wire import ErrorFrame, Final, Heartbeat, Token, Usage, encode


class FrameSender:
    def __init__(self, nc: Client, subject: str, attempt: int, heartbeat_s: float) -> None:
        self._nc = nc
        self._subject = subject
        self._attempt = attempt
        self._heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self.seq = 0  # seq of the last token sent
        self.closed = False
        self.outcome = ""  # the finish reason or error code of the terminal frame

    @property
    def started(self) -> bool:
        return self.seq > 0

    async def _publish(self, payload: bytes) -> None:
        self._last_sent = time.monotonic()
        await self._nc.publish(self._subject, payload)

    async def token(
        self,
        text: str,
        tool_calls: list[dict[str, Any]] | None = None,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
    ) -> None:
        self.seq += 1
        frame = Token(self.seq, text, tool_calls, finish_reason, self._attempt, logprobs, index)
        await self._publish(encode(frame))

    async def final(self, **fields: Any) -> None:
        self.closed = True
        self.outcome = str(fields.get("finish_reason", "stop"))
        usage = fields.pop("usage", Usage())
        frame = Final(seq=self.seq + 1, usage=usage, attempt=self._attempt, **fields)
        await self._publish(encode(frame))

    async def error(self, code: str, message: str, *, status: int, retryable: bool) -> None:
        self.closed = True
        self.outcome = code
        frame = ErrorFrame(self.seq + 1, code, message, retryable, status, self._attempt)
        await self._publish(encode(frame))

    async def heartbeats(self) -> None:
        """Run until cancelled: a heartbeat whenever nothing went out for a beat."""
        while not self.closed:
            await asyncio.sleep(self._heartbeat_s / 2)
            if not self.closed and time.monotonic() - self._last_sent >= self._heartbeat_s:
                await self._publish(encode(Heartbeat(self.seq, time.time(), self._attempt)))

"""One keep-alive HTTP/1.1 client socket for workers.engines.lean_http: an
asyncio Protocol that feeds bytes to httptools as they arrive and wakes the one
reader awaiting them (no StreamReader layer, no per-line str objects)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import cast

import httptools

from workers.errors import EngineConnectionLost, EngineUnreachable

LINGER_S = 2.0  # how long a finished stream may take to send its terminator
_HIGH_WATER = 256 * 1024  # unread body bytes before the socket stops being read


class Stale(Exception):
    """The connection closed before any response byte (a stale keep-alive)."""


class Conn(asyncio.Protocol):
    """One socket: parses responses as bytes arrive; the reader awaits them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, forget: Callable[[Conn], None]) -> None:
        self._loop = loop
        self._forget = forget
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._on_settle: Callable[[Conn], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.idle = False
        self.reset()

    def reset(self) -> None:
        self.got_bytes = False
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.framed = False  # Content-Length or chunked; else the body ends at close
        self.broken: str | None = None
        self._chunks.clear()  # bytes past the last response's end (lingered ones)
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A read/write transport (uvloop's are not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.idle:  # nothing was asked: an idle connection that speaks is unusable
            self.close()
            return
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.broken = f"malformed response from engine: {exc}"
            self.close()
        self._wake()
        if self.complete and self._on_settle is not None:
            self._settle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and not self.framed:
            self.complete = True  # a body delimited by the close itself
        self._forget(self)
        self._wake()
        if self._on_settle is not None:
            self._settle()

    # -- httptools callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.framed and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True

    # -- used by the exchange --
    @property
    def status(self) -> int:
        return self._parser.get_status_code()

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def wait_head(self) -> None:
        while not self.head_done:
            if self.broken is not None:
                raise EngineUnreachable(self.broken)
            if self.closed:
                if not self.got_bytes:
                    raise Stale
                raise EngineUnreachable("engine closed the connection mid-response")
            await self._wait()

    async def read(self) -> bytes:
        """The next body bytes; b"" at the end of the body."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.broken is not None:
                raise EngineConnectionLost(self.broken)
            if self.closed:
                raise EngineConnectionLost("engine closed the stream mid-response")
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def linger(self, on_settle: Callable[[Conn], None]) -> None:
        """Settle once the response completes (or the connection goes), or close
        after LINGER_S: an engine that never finishes must not pin a slot."""
        self._on_settle = on_settle
        self._timer = self._loop.call_later(LINGER_S, self._give_up)

    def _give_up(self) -> None:
        self.close()
        self._settle()

    def _settle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        on_settle, self._on_settle = self._on_settle, None
        if on_settle is not None:
            on_settle(self)

    async def _wait(self) -> None:
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

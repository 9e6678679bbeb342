"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol plus the two
things it lacks.

- **A bound on the request head.** httptools buffers a request line or a header
  of any length until it ends, so one endless header would grow the process
  without limit. Two counts keep a head within ``max_head_bytes``: the parsed
  request line and headers (exact), and the raw bytes read while a head is still
  incomplete (so a header that never ends is cut one read past the bound). Past
  either, the answer is 431 and the connection is closed. (uvicorn's h11 protocol
  has ``h11_max_incomplete_event_size`` for this; httptools has no equivalent, and
  h11 is several times slower.)
- **A deadline for a request to arrive.** uvicorn times a connection out only
  between requests (keep-alive); one that connects and sends nothing, or trickles
  its head or body a byte at a time (slowloris), holds its socket for ever. A
  request's head and body must arrive within ``read_timeout_s`` of its first byte
  (of the connection, for the first): past it the answer is 408 and the connection
  is closed. Upgraded (WebSocket) connections have their own idle bound.
- **A lingering close** (RFC 9112 section 9.6). uvicorn closes the socket right
  after a ``Connection: close`` answer. When the client is still sending (a 413 for
  a body over the cap, a 431), unread input makes the kernel answer with a reset,
  and the reset destroys the answer in the client's buffer before it is read: the
  client sees a broken connection instead of the 413. So while a request is still
  arriving, a close half-closes instead (the answer, then FIN), reads and
  *discards* what still arrives, and closes for good when the client closes, or
  after :data:`LINGER_S`. Nothing discarded is parsed or kept.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import GatewayError, HeadersTooLarge

# Long enough for a client that writes its whole body before reading (httpx does)
# to finish a large upload on a local network; short enough that a client which
# never stops sending costs one connection for seconds, not forever.
LINGER_S = 5.0


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class _HeadTooLarge(Exception):
    """Raised in a parser callback to stop parsing a head over the bound."""


class _Transport:
    """The connection's transport as uvicorn's protocol and request cycles see it:
    everything is the real transport's, except that closing goes through the
    protocol, which may linger."""

    def __init__(self, real: asyncio.Transport, owner: BoundedHttpToolsProtocol) -> None:
        self._real = real
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def close(self) -> None:
        self._owner.close_connection()

    def is_closing(self) -> bool:
        return self._owner.lingering or self._real.is_closing()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = 64 * 1024
    send_buffer = 0  # SO_SNDBUF of each connection; 0: the kernel's autotuning
    linger_s = LINGER_S
    read_timeout_s = 30.0  # a request's head and body, from its first byte

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.lingering = False
        self._real: asyncio.Transport | None = None
        self._in_head = True  # bytes now belong to a request head
        self._in_message = False  # a request has begun and not fully arrived
        self._unparsed_head_bytes = 0  # read while the head is incomplete
        self._head_size = 0  # the request line and headers parsed so far
        self._head_over = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._real = cast(asyncio.Transport, transport)
        if self.send_buffer:
            # A fixed send buffer (the kernel doubles it) instead of autotuning:
            # a client that stops reading parks at most this much in the kernel,
            # then the gateway's frame buffer fills and the stream is ended.
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        super().connection_made(cast(asyncio.Transport, _Transport(self._real, self)))
        self._arm_read_timer()  # the first request's first byte, and all of it

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._disarm_read_timer()
        super().connection_lost(exc)

    def _arm_read_timer(self) -> None:
        self._disarm_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        real = self._real
        if real is None or real.is_closing() or self.lingering:
            return
        if real.get_protocol() is not self:
            return  # upgraded: the WebSocket's own idle bound applies
        if self.pipeline or (self.cycle is not None and self.cycle.response_started):
            # An answer is under way (this request's, or an earlier one's while
            # this one waits its turn): nothing else can be said in order.
            self._close_unanswered()
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The app waits for the body: it hears a disconnect, and what it
            # would answer is dropped (this 408 is the answer).
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        err = RequestTimeout(
            f"The request did not arrive within {self.read_timeout_s:g} s of its start."
        )
        self._refuse(b"408 Request Timeout", err)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a refused request: dropped unread
        if self._in_head:
            self._unparsed_head_bytes += len(data)
        super().data_received(data)
        # A chunk that completes its head resets the count: what is left is a head
        # that has not ended within the bound.
        over = self._in_head and self._unparsed_head_bytes > self.max_head_bytes
        if over and not self.lingering:
            self._refuse_head()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to any parser error, _HeadTooLarge from a callback included.
        if self._head_over:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def _grow_head(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self.max_head_bytes:
            self._head_over = True
            raise _HeadTooLarge  # out of the parser: it stops here, and says 400 (see above)

    # -- parser callbacks (uvicorn's, plus where a head and a message begin and end)
    def on_message_begin(self) -> None:
        self._in_message = True
        self._head_size = 0
        self._arm_read_timer()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._grow_head(len(url) + 16)  # the method and version, roughly

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._unparsed_head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_message = False
        self._in_head = True
        self._disarm_read_timer()  # arrived; between requests keep-alive's bound applies
        super().on_message_complete()

    # -- closing -------------------------------------------------------------------
    def close_connection(self) -> None:
        """Close now, or linger while the client is still sending a request."""
        real = self._real
        assert real is not None
        upgraded = real.get_protocol() is not self  # a WebSocket now owns the transport
        if upgraded or self.lingering or not self._in_message or real.is_closing():
            # A second close (server shutdown, the linger's end) is final.
            real.close()
            return
        self.lingering = True
        if real.can_write_eof():
            real.write_eof()  # after what is buffered: the answer arrives whole
        real.resume_reading()  # the client must not block on a full window meanwhile
        self._linger_timer = self.loop.call_later(self.linger_s, real.close)

    def _refuse_head(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's head, over the bound while the answer to the
            # one before it is still to be written: a refusal now would land inside
            # that answer (a streamed one's body, which then failed with no outcome).
            # Nothing can be said in order: close; the earlier request hears the
            # disconnect and ends as a client that left.
            self._close_unanswered()
            return
        err = HeadersTooLarge(
            f"Request head over the gateway's limit of {self.max_head_bytes} bytes."
        )
        self._refuse(b"431 Request Header Fields Too Large", err)

    def _close_unanswered(self) -> None:
        assert self._real is not None
        self._disarm_read_timer()
        self.lingering = True  # what still arrives is dropped unread
        self._real.close()

    def _refuse(self, status: bytes, err: GatewayError) -> None:
        """Answer ``err`` on the connection itself (no request cycle to answer
        it) and close, lingering over what is still arriving."""
        assert self._real is not None
        self._disarm_read_timer()
        body = err.json()
        head = [b"HTTP/1.1 " + status + b"\r\n"]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"content-type: application/json\r\n")
        head.append(b"content-length: " + str(len(body)).encode() + b"\r\n")
        head.append(b"connection: close\r\n\r\n")
        self._real.write(b"".join(head) + body)
        self._in_message = True  # the request is still arriving: linger over it
        self.close_connection()


def protocol_class(
    max_head_bytes: int, send_buffer: int = 0, read_timeout_s: float = 30.0
) -> type[BoundedHttpToolsProtocol]:
    """The protocol for uvicorn's ``http=`` setting, with these bounds."""

    class Configured(BoundedHttpToolsProtocol):
        pass

    Configured.max_head_bytes = max_head_bytes
    Configured.send_buffer = send_buffer
    Configured.read_timeout_s = read_timeout_s
    return Configured

"""The gateway's WebSocket protocol: uvicorn's sans-I/O one, with a bound on how
long the connection waits for a client that does not read.

uvicorn waits for such a client for ever, in two places. A send waits for the
transport to become writable again; and every close (the idle timeout's, the
keepalive's, the end of the app) is the transport's ``close()``, which first
waits for the unsent bytes to drain. A client that stopped reading (its receive
window at zero) so held the send, the request task behind it, the socket and its
file descriptor for as long as its kernel kept acknowledging zero-window probes.
Here each of those waits ends after ``send_timeout_s``: the connection is aborted
(no drain), the socket freed, the app sees a disconnect, and each request in
flight on it ends once, cancelled upstream (gateway/ingress/ws.py).
"""

from __future__ import annotations

import asyncio
from asyncio import BaseTransport, Transport
from typing import Any, cast

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class _BoundedClose:
    """The connection's transport, whose ``close()`` aborts it if the unsent
    bytes have not drained ``bound_s`` later."""

    def __init__(self, transport: Transport, bound_s: float) -> None:
        self._transport = transport
        self._bound_s = bound_s
        self.abort_timer: asyncio.TimerHandle | None = None

    def close(self) -> None:
        closing = self._transport.is_closing()  # (closed: connection_lost's own close)
        self._transport.close()
        if self.abort_timer is None and not closing:
            loop = asyncio.get_running_loop()
            self.abort_timer = loop.call_later(self._bound_s, self._transport.abort)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
    send_timeout_s = 30.0

    def connection_made(self, transport: BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses: no isinstance.)
        bounded = _BoundedClose(cast(Transport, transport), self.send_timeout_s)
        super().connection_made(cast(Transport, bounded))

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self.transport, "abort_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)

    async def send(self, message: ASGISendEvent) -> None:
        if not self.writable.is_set():  # the client's buffer is full: it is not reading
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await self.writable.wait()
            except TimeoutError:
                self.transport.abort()  # not close(): that waits for the buffer to drain
                raise ClientDisconnected from None
        await super().send(message)


def ws_protocol_class(send_timeout_s: float) -> type[BoundedWebSocketProtocol]:
    """The protocol for uvicorn's ``ws=`` setting, with this bound."""

    class Configured(BoundedWebSocketProtocol):
        pass

    Configured.send_timeout_s = send_timeout_s
    return Configured

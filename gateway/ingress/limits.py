"""Request limits checked before any work: a pure ASGI middleware around an app.

- More than ``max_headers`` headers: 431, for HTTP and for a WebSocket upgrade (the
  upgrade is refused, never accepted).
- A ``Content-Length`` over ``max_body_bytes``: 413 at once, before the app runs, so
  nothing of the body is read, nor the request authenticated or parsed.
- A body without a length (chunked) is counted as the app reads it: the read that
  would pass the cap raises :class:`BodyTooLarge` instead of returning bytes, so the
  app has buffered at most the cap. The app's error handler answers 413.

Every refusal carries ``Connection: close``: the server then closes the connection
without reading the rest of the body (a lingering close,
:mod:`gateway.ingress.http_protocol`). The byte count of the head (request line and
headers) is bounded earlier, in the HTTP protocol, where it is still being read.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import BadRequest, BodyTooLarge, HeadersTooLarge
from gateway.web import refuse


class RequestLimits:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_headers: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if len(headers) > self.max_headers:
            err = HeadersTooLarge(
                f"Too many request headers: {len(headers)}; at most {self.max_headers}."
            )
            await refuse(scope, send, err)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        try:
            length = _content_length(headers)
        except BadRequest as exc:
            await refuse(scope, send, exc)
            return
        if length is not None and length > self.max_body_bytes:
            await refuse(scope, send, self._too_large(length))
            return
        await self._capped(scope, receive, send)

    async def _capped(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large(None)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge as exc:
            # The app had no handler for it (both of ours have: they answer the same).
            if started:
                raise
            await refuse(scope, send, exc)

    def _too_large(self, length: int | None) -> BodyTooLarge:
        size = f"{length} bytes" if length is not None else "longer"
        return BodyTooLarge(
            f"Request body too large ({size}): the gateway's limit is {self.max_body_bytes} bytes."
        )


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            # The HTTP parser already refuses a malformed or repeated length; this
            # only keeps a non-number from becoming a 500.
            if not value.isdigit():
                raise BadRequest("Content-Length must be a non-negative integer.")
            return int(value)
    return None

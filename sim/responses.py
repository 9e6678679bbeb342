"""An ASGI response that runs its body while watching for the client to go away.

Starlette's StreamingResponse notices a disconnect only between chunks it sends; a
request that is waiting in the queue, prefilling, stalled, or building a non-stream
reply sends nothing. This response races the body against `http.disconnect` and
cancels the body at once, so the engine aborts the sequence (GPU time stops).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

Body = Callable[[Send], Awaitable[None]]


class Dropped(Exception):
    """Raised by a body to cut the connection abruptly (the drop:N fault)."""


class GuardedResponse(Response):
    def __init__(self, body: Body) -> None:
        # Response.__init__ would render content; the body sends its own messages.
        self._body = body
        self.background = None
        self.status_code = 200
        self.raw_headers = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        work = asyncio.ensure_future(self._body(tracked_send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                task.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled():
            return  # the client went away; the body has already aborted its sequence
        exc = work.exception()
        if isinstance(exc, Dropped):
            if not started:
                # Promise a body and never send it: the client sees a truncated reply.
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", b"1"),
                        ],
                    }
                )
            # Returning with the response incomplete makes the server close the socket.
            return
        if exc is not None:
            raise exc


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

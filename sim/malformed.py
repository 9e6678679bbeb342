"""Stream faults. `malformed:N`: the N-th SSE event (0-based) is replaced by one
that is not JSON, as a buggy proxy or a truncated write would produce.
`inband:STATUS`: the first event is the engine's error event, in the dialect's own
form, and the stream ends there: a real engine fails that way after the headers
(vLLM when its engine dies mid-request, TGI for every error of a stream)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from sim.faults import Fault, FaultKind

BAD_EVENT = b'data: {"choices": [{"delta": {"content": "unterminated\n\n'


class _Wrapped(Response):
    """A response whose body messages pass through this one on their way out."""

    def __init__(self, inner: Response) -> None:
        # Response.__init__ would render content; the inner response sends its own.
        self._inner = inner
        self.background = None
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers


class _Malformed(_Wrapped):
    def __init__(self, inner: Response, at: int) -> None:
        super().__init__(inner)
        self._at = at

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = 0

        async def corrupt(message: Message) -> None:
            nonlocal seen
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and body.startswith(b"data:"):
                if seen == self._at:
                    message = {**message, "body": BAD_EVENT}
                seen += 1
            await send(message)

        await self._inner(scope, receive, corrupt)


class _InBand(_Wrapped):
    def __init__(self, inner: Response, event: bytes) -> None:
        super().__init__(inner)
        self._event = event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = False

        async def fail(message: Message) -> None:
            nonlocal ended
            if ended:
                return  # the engine's own stream goes on unheard
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and body.startswith(b"data:"):
                ended = True
                await send({"type": "http.response.body", "body": self._event, "more_body": False})
                return
            await send(message)

        await self._inner(scope, receive, fail)


def openai_error_event(status: int) -> bytes:
    """vLLM's: the error, then ``[DONE]``."""
    error = {"message": f"engine error {status} (simulated, in-band)", "type": "BadRequestError"
             if status < 500 else "InternalServerError", "param": None, "code": status}  # fmt: skip
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\ndata: [DONE]\n\n"


def tgi_error_event(status: int) -> bytes:
    kind = "overloaded" if status == 429 else "validation" if status < 500 else "generation"
    event = {"error": f"engine error {status} (simulated, in-band)", "error_type": kind}
    return b"data:" + msgspec.json.encode(event) + b"\n\n"


def with_malformed(
    fault: Fault | None, response: Response, error_event: Callable[[int], bytes] | None = None
) -> Response:
    """``response`` with the stream fault ``fault`` asks for (``error_event``: the
    dialect's in-band error; without one, ``inband`` is not applied)."""
    if fault is not None and fault.kind is FaultKind.INBAND and error_event is not None:
        return _InBand(response, error_event(fault.arg or 500))
    if fault is None or fault.kind is not FaultKind.MALFORMED:
        return response
    return _Malformed(response, fault.arg or 0)

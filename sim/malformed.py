"""The `malformed:N` fault for the OpenAI surface: the N-th SSE event (0-based) is
replaced by one that is not JSON, as a buggy proxy or a truncated write would produce."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from sim.faults import Fault, FaultKind

BAD_EVENT = b'data: {"choices": [{"delta": {"content": "unterminated\n\n'


class _Malformed(Response):
    def __init__(self, inner: Response, at: int) -> None:
        # Response.__init__ would render content; the inner response sends its own.
        self._inner = inner
        self._at = at
        self.background = None
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers

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


def with_malformed(fault: Fault | None, response: Response) -> Response:
    if fault is None or fault.kind is not FaultKind.MALFORMED:
        return response
    return _Malformed(response, fault.arg or 0)

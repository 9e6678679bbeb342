"""The HTTP plumbing every engine adapter shares: one pooled client per
adapter, the streaming call, the health probe, the metrics scrape, and the one
mapping from an engine's HTTP status to a worker error (``workers.errors``)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable

import httpx
import msgspec

from workers.errors import (
    EngineConnectionLost,
    EngineRateLimited,
    EngineRejected,
    EngineUnavailable,
    EngineUnreachable,
    ResponseTooLarge,
)

PROBE_TIMEOUT_S = 2.0
# What a worker reads of an engine at most, before it decodes anything: an engine
# (broken, or not the one configured) must not grow a worker without bound.
MAX_SSE_LINE = 4 << 20  # an SSE line (a frame must fit the bus's 1 MB besides)
MAX_BODY = 16 << 20  # a whole answer (embeddings as JSON floats: ~4x their frame)
MAX_ERROR_BODY = 64 << 10  # an error body: the message is cut to 4096 anyway
_EOL = re.compile(r"\r\n|\r|\n")

StatusCheck = Callable[[int, bytes], None]


def engine_client(
    base_url: str,
    api_key: str | None = None,
    *,
    max_connections: int = 256,
    connect_timeout: float = 5.0,
) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
        # Reads may legitimately wait long (queued in the engine); the request's
        # deadline bounds the whole call instead.
        timeout=httpx.Timeout(connect=connect_timeout, read=None, write=30.0, pool=30.0),
    )


def error_message(body: bytes) -> str:
    """The message of an engine's error body, as text: OpenAI's ``{"error":
    {"message"}}``, a bare ``{"message"}`` or ``{"error": "..."}``, FastAPI's
    ``{"detail"}`` (vLLM's routes that do not exist), or the body itself."""
    text = body[:500].decode("utf-8", "replace")
    try:
        err = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return text
    if not isinstance(err, dict):
        return text
    inner = err.get("error", err)
    if isinstance(inner, str):
        return inner
    for holder in (inner, err):
        if isinstance(holder, dict):
            for key in ("message", "detail"):
                value = holder.get(key)
                if isinstance(value, str) and value:
                    return value
    return text


def raise_for_status(status: int, body: bytes) -> None:
    """429: rate limited; 5xx: unavailable (retryable before the first token);
    other 4xx: the request itself is bad. An adapter with dialect quirks maps
    them to one of these statuses first."""
    if status < 400:
        return
    message = error_message(body)
    if status == 429:
        raise EngineRateLimited(message)
    if status >= 500:
        raise EngineUnavailable(message, status=503 if status == 503 else 502)
    raise EngineRejected(message, status=status)


@contextlib.asynccontextmanager
async def open_stream(
    client: httpx.AsyncClient, request: httpx.Request, check: StatusCheck = raise_for_status
) -> AsyncIterator[httpx.Response]:
    """Send a streaming request: the open response, closed on exit (closing it
    mid-stream is how the engine learns to stop). Unreachable: EngineUnavailable;
    an error status goes through ``check``."""
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise EngineUnreachable(f"engine unreachable: {exc!r}") from exc
    try:
        if response.status_code >= 400:
            check(response.status_code, await read_body(response, MAX_ERROR_BODY, cut=True))
        yield response
    finally:
        await response.aclose()


class CappedBody:
    """A body read chunk by chunk, at most ``cap`` bytes: past it ResponseTooLarge,
    or (``cut``, for error bodies) the first ``cap`` bytes and no more."""

    def __init__(self, cap: int, cut: bool) -> None:
        self._cap, self._cut = cap, cut
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk``; False when the body is full (cut): read no more."""
        self._size += len(chunk)
        if self._size <= self._cap:
            self._parts.append(chunk)
            return True
        if not self._cut:
            raise ResponseTooLarge(f"The engine's answer is over {self._cap} bytes.")
        self._parts.append(chunk[: self._cap - self._size + len(chunk)])
        return False

    def bytes(self) -> bytes:
        return b"".join(self._parts)


async def read_body(response: httpx.Response, cap: int, *, cut: bool = False) -> bytes:
    """A streamed httpx response's body (:class:`CappedBody`)."""
    body = CappedBody(cap, cut)
    try:
        async for chunk in response.aiter_bytes():
            if not body.add(chunk):
                break
    except httpx.TransportError as exc:
        raise EngineConnectionLost(f"engine stream broke: {exc!r}") from exc
    return body.bytes()


def line_too_long() -> ResponseTooLarge:
    return ResponseTooLarge(
        f"An engine stream line is over {MAX_SSE_LINE} bytes: no frame can carry it "
        "(ask for fewer logprobs or a shorter echo)."
    )


async def lines(response: httpx.Response) -> AsyncIterator[str]:
    """A streamed response's lines (CR, LF or CRLF ends, as httpx's ``aiter_lines``),
    each at most MAX_SSE_LINE characters: a line that never ends breaks the stream
    instead of growing the worker. A CRLF split between two reads gives one extra
    empty line, which SSE readers skip as they skip every blank separator."""
    pending: list[str] = []
    size = 0
    try:
        async for text in response.aiter_text():
            start = 0
            for end in _EOL.finditer(text):
                pending.append(text[start : end.start()])
                yield "".join(pending)
                pending.clear()
                size, start = 0, end.end()
            if start < len(text):
                pending.append(text[start:])
                size += len(text) - start
                if size > MAX_SSE_LINE:
                    raise line_too_long()
    except httpx.TransportError as exc:
        raise EngineConnectionLost(f"engine stream broke: {exc!r}") from exc
    if pending:
        yield "".join(pending)


async def probe(client: httpx.AsyncClient, path: str) -> bool:
    """Whether the engine answers ``path`` with 200 (readiness)."""
    try:
        response = await client.get(path, timeout=PROBE_TIMEOUT_S)
    except httpx.TransportError:
        return False
    return response.status_code == 200


async def read_version(client: httpx.AsyncClient, path: str, name: str) -> str:
    """``"<name> <version>"`` from the JSON at ``path`` (its ``version``), "" when
    the engine does not answer it (an older build, another server)."""
    try:
        response = await client.get(path, timeout=PROBE_TIMEOUT_S)
        found = response.json().get("version") if response.status_code == 200 else None
    except (httpx.TransportError, ValueError, AttributeError):
        return ""
    return f"{name} {found}"[:128] if isinstance(found, str) and found else ""


async def scrape(client: httpx.AsyncClient, url: str) -> str | None:
    """The engine's Prometheus text, or None when it cannot be read now."""
    try:
        response = await client.get(url, timeout=PROBE_TIMEOUT_S)
    except httpx.TransportError:
        return None
    return response.text if response.status_code == 200 else None

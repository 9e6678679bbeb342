"""A lean HTTP/1.1 client for the hot paths: streaming a chat or completion
from an engine over plain ``http://`` (issue 14: httpx's send path was ~26% of
a worker's CPU), and the load scrape and health probe a worker sends its engine
every half second (through httpx they were most of an idle worker's CPU), and
embeddings (issue 17). Everything else (TLS, /tokenize, /version) stays on httpx.

One pool per client, i.e. per engine (host, port): at most ``max_connections``
sockets, idle ones reused last-in first-out (the warmest). A stream that ends
early (the caller stops, is cancelled, or fails) closes its socket, never
returning a half-read connection: the engine sees the close and aborts. A
stream that reached ``data: [DONE]`` goes back to the pool once the engine's
last bytes (the chunked terminator) arrive, without making the caller wait.
A reused connection that closes before any response byte (the server dropped
it while idle) is retried once on a fresh one; nothing else is retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import TracebackType
from urllib.parse import urlsplit

from workers.engines.http import (
    MAX_BODY,
    MAX_ERROR_BODY,
    MAX_SSE_LINE,
    PROBE_TIMEOUT_S,
    CappedBody,
    StatusCheck,
    line_too_long,
    raise_for_status,
)
from workers.engines.lean_conn import Conn, Stale
from workers.errors import EngineError, EngineRejected, EngineUnavailable, EngineUnreachable

POOL_TIMEOUT_S = 30.0  # as engine_client's pool timeout
_END = b"[DONE]"  # the OpenAI stream's last event


class LeanClient:
    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        max_connections: int = 256,
        connect_timeout: float = 5.0,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the lean client speaks plain http:// only: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]
        # Keyed by lower-case name, so a caller's header replaces a default one.
        self._defaults = {"host": ("Host", host), "user-agent": ("User-Agent", "jetserve")}
        for name, value in (headers or {}).items():
            self._defaults[name.lower()] = (name, value)
        self._connect_timeout = connect_timeout
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[Conn] = []  # LIFO
        self._all: set[Conn] = set()
        self._closed = False
        self.connects = 0  # TCP connections opened (tests, the benchmark)

    def stream(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        check: StatusCheck = raise_for_status,
    ) -> Exchange:
        """``async with client.stream(...) as response``: POST ``body``; an
        error status goes through ``check`` (with the whole error body)."""
        return Exchange(self, self._request(path, body, headers), check)

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path``: (status, whole body), any status; EngineUnavailable
        when unreachable. The caller bounds the time (``asyncio.timeout``)."""
        return await self._whole(self._request(path, b"", {}, "GET"))

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """POST ``body`` to ``path``: as ``get`` (the embeddings bench's load)."""
        return await self._whole(self._request(path, body, headers))

    async def _whole(self, request: bytes) -> tuple[int, bytes]:
        async with Exchange(self, request, _any_status) as response:
            return response.status, await response.read()

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing

    def _request(
        self, path: str, body: bytes, headers: Mapping[str, str], method: str = "POST"
    ) -> bytes:
        fields = self._defaults
        if headers:
            fields = dict(fields)
            for name, value in headers.items():
                fields[name.lower()] = (name, value)
        lines = [f"{method} {self._prefix}{path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n"]
        for name, value in fields.values():
            if "\n" in name or "\r" in name or "\n" in value or "\r" in value:
                raise EngineRejected(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        try:
            return "".join(lines).encode("latin-1") + body
        except UnicodeEncodeError as exc:
            raise EngineRejected(f"header not encodable: {exc}") from exc

    async def _acquire(self) -> None:
        if self._closed:
            raise EngineUnavailable("engine client is closed")
        if not self._slots.locked():
            await self._slots.acquire()
            return
        try:
            async with asyncio.timeout(POOL_TIMEOUT_S):
                await self._slots.acquire()
        except TimeoutError:
            raise EngineUnavailable("no engine connection free") from None

    async def _checkout(self, fresh: bool) -> tuple[Conn, bool]:
        """A connection and whether it is a reused idle one."""
        while self._idle and not fresh:
            conn = self._idle.pop()
            conn.idle = False
            if not conn.closed:
                conn.reset()
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Conn(loop, self._forget), self._host, self._port
                )
        except (OSError, TimeoutError) as exc:
            raise EngineUnreachable(
                f"engine unreachable at {self._host}:{self._port}: {exc!r}"
            ) from exc
        self.connects += 1
        self._all.add(conn)
        return conn, False

    def _settle(self, conn: Conn) -> None:
        """An exchange is over: its slot frees; its socket idles or closes."""
        if conn.complete and conn.keep_alive and not conn.closed and not self._closed:
            conn.idle = True
            self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()

    def _forget(self, conn: Conn) -> None:
        self._all.discard(conn)
        if conn.idle:
            conn.idle = False
            if conn in self._idle:
                self._idle.remove(conn)


def _any_status(status: int, body: bytes) -> None:
    """A check that lets every status through (the caller reads it)."""


class Exchange:
    """One request on one pooled connection, as an async context manager."""

    def __init__(self, client: LeanClient, request: bytes, check: StatusCheck) -> None:
        self._client = client
        self._request = request
        self._check = check
        self._conn: Conn | None = None
        self._response: LeanResponse | None = None

    async def __aenter__(self) -> LeanResponse:
        client = self._client
        await client._acquire()
        try:
            conn = await self._attempt(fresh=False)
            if conn is None:  # the stale keep-alive rule: once, on a fresh socket
                conn = await self._attempt(fresh=True)
            assert conn is not None
            response = self._response = LeanResponse(conn)
            if response.status >= 400:
                self._check(response.status, await response.read(MAX_ERROR_BODY, cut=True))
        except BaseException:
            self._finish()
            raise
        return response

    async def _attempt(self, *, fresh: bool) -> Conn | None:
        """Send on a connection and await the response head; None when it was
        a reused idle one that closed before answering (safe to send again)."""
        self._conn = None
        conn, reused = await self._client._checkout(fresh)
        self._conn = conn
        conn.send(self._request)
        try:
            await conn.wait_head()
        except Stale:
            conn.close()
            if reused:
                return None
            raise EngineUnreachable("engine closed the connection unanswered") from None
        return conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()

    def _finish(self) -> None:
        conn, client = self._conn, self._client
        if conn is None:
            client._slots.release()
        elif conn.complete or conn.closed:
            client._settle(conn)
        elif self._response is not None and self._response.ended:
            conn.linger(client._settle)  # only the terminator is still to come
        else:
            conn.close()  # half-read: the engine must see the close
            client._settle(conn)


class LeanResponse:
    __slots__ = ("_conn", "ended", "status")

    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        self.status = conn.status
        self.ended = False  # the stream's end marker was read

    async def read(self, cap: int = MAX_BODY, *, cut: bool = False) -> bytes:
        """The rest of the body, at most ``cap`` bytes: past it ResponseTooLarge,
        or (``cut``, for error bodies) the first ``cap`` bytes (the connection is
        then closed, not reused: the rest is unread)."""
        body = CappedBody(cap, cut)
        while chunk := await self._conn.read():
            if not body.add(chunk):
                break
        return body.bytes()

    def sse_data(self) -> SSEData:
        return SSEData(self)


class SSEData:
    """The payload of each ``data:`` line, as bytes (msgspec decodes them as
    they are), until ``[DONE]`` or the body's end. Other lines are skipped."""

    __slots__ = ("_buf", "_conn", "_pos", "_response")

    def __init__(self, response: LeanResponse) -> None:
        self._response = response
        self._conn = response._conn
        self._buf = b""
        self._pos = 0

    def __aiter__(self) -> SSEData:
        return self

    async def __anext__(self) -> bytes:
        buf, pos = self._buf, self._pos
        while True:
            nl = buf.find(b"\n", pos)
            if nl < 0:
                if len(buf) - pos > MAX_SSE_LINE:
                    # A line no engine sends (its frame must fit the bus's 1 MB):
                    # cut here, before it grows the worker (and the copy of it each
                    # read makes, kept for the speed of ordinary lines) without bound.
                    raise line_too_long()
                more = await self._conn.read()
                if more:
                    buf = buf[pos:] + more if pos < len(buf) else more
                    pos = 0
                    continue
                if pos >= len(buf):
                    self._buf, self._pos = b"", 0
                    raise StopAsyncIteration
                nl = len(buf)  # a last line without its newline
            start, end = pos, nl
            pos = nl + 1
            if not buf.startswith(b"data:", start):
                continue  # comments, event names, blank separators
            start += 5
            if start < end and buf[start] == 32:  # one optional space
                start += 1
            if end > start and buf[end - 1] == 13:  # CRLF line ends
                end -= 1
            payload = buf[start:end]
            self._buf, self._pos = buf, pos
            if payload == _END:
                self._response.ended = True
                raise StopAsyncIteration
            return payload


async def lean_probe(client: LeanClient, path: str) -> bool:
    """``probe`` on the lean client (plain http://)."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            status, _ = await client.get(path)
    except (EngineError, TimeoutError):
        return False
    return status == 200


async def lean_scrape(client: LeanClient, path: str) -> str | None:
    """``scrape`` on the lean client (plain http://)."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            status, body = await client.get(path)
    except (EngineError, TimeoutError):
        return None
    return body.decode(errors="replace") if status == 200 else None

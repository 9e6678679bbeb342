"""The lean engine client (workers/engines/lean_http.py) against a real local
TCP server speaking raw HTTP/1.1: framing, SSE lines split anywhere, keep-alive
reuse, stale connections, error statuses, and cancellation reaching the server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from jetserve.services import free_port
from tests.waits import until_true
from workers.engines import lean_conn
from workers.engines.base import Delta, Done
from workers.engines.http import MAX_BODY, MAX_SSE_LINE
from workers.engines.lean_http import LeanClient, LeanResponse
from workers.engines.openai import OpenAIAdapter, _status_of
from workers.errors import (
    EngineRateLimited,
    EngineRejected,
    EngineStreamBroken,
    EngineUnavailable,
    ResponseTooLarge,
)

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENTS = b'data: {"a":1}\n\n: a comment\r\ndata:{"b":2}\r\n\r\ndata: [DONE]\n\n'


def chunk(piece: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def chunked(*pieces: bytes) -> bytes:
    return SSE_HEAD + b"".join(chunk(p) for p in pieces) + b"0\r\n\r\n"


def error(status: int, message: str) -> bytes:
    body = b'{"error":{"message":"%s","type":"x"}}' % message.encode()
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


@dataclass
class Seen:
    conn: int  # which connection (0, 1, ...) carried the request
    head: bytes
    body: bytes


Respond = Callable[[Seen, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class Server:
    """Reads requests; ``respond`` answers each (False: close the connection)."""

    respond: Respond
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        conn, self.connections = self.connections, self.connections + 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                seen = Seen(conn, head, await reader.readexactly(length))
                self.seen.append(seen)
                if not await self.respond(seen, reader, writer):
                    return
        finally:
            writer.close()


def replies(*answers: bytes, keep: bool = True) -> Respond:
    """Answer the n-th request with answers[n] (the last one repeats); ``keep``:
    keep the connection open after answering."""
    count = 0

    async def respond(_s: Seen, _r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        nonlocal count
        w.write(answers[min(count, len(answers) - 1)])
        count += 1
        await w.drain()
        return keep

    return respond


Start = Callable[[Respond], Awaitable[tuple[Server, LeanClient]]]


@contextlib.asynccontextmanager
async def servers() -> AsyncIterator[Start]:
    made: list[tuple[Server, asyncio.Server, LeanClient]] = []

    async def make(respond: Respond) -> tuple[Server, LeanClient]:
        srv = Server(respond)
        listener = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        client = LeanClient(f"http://127.0.0.1:{port}/base", max_connections=4)
        made.append((srv, listener, client))
        return srv, client

    try:
        yield make
    finally:
        for srv, listener, client in made:
            await client.aclose()
            listener.close()
            for task in srv.tasks:
                task.cancel()
            await asyncio.gather(*srv.tasks, return_exceptions=True)


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    async with servers() as make:
        yield make


async def payloads(client: LeanClient, headers: dict[str, str] | None = None) -> list[bytes]:
    async with client.stream("/v1/chat", b'{"x":1}', headers or {}) as response:
        return [p async for p in response.sse_data()]


class Pieces:
    """A connection stand-in that hands out the body in the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.status = 200
        self._pieces = pieces

    async def read(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


async def test_sse_lines_split_at_every_byte_boundary() -> None:
    expected = [b'{"a":1}', b'{"b":2}']
    for cut in range(1, len(EVENTS)):
        response = LeanResponse(Pieces([EVENTS[:cut], EVENTS[cut:]]))  # type: ignore[arg-type]
        assert [p async for p in response.sse_data()] == expected, cut
        assert response.ended
    one_by_one = LeanResponse(Pieces([bytes([b]) for b in EVENTS]))  # type: ignore[arg-type]
    assert [p async for p in one_by_one.sse_data()] == expected
    last = LeanResponse(Pieces([b"data: 1\n", b"data: 2"]))  # type: ignore[arg-type]
    assert [p async for p in last.sse_data()] == [b"1", b"2"]  # a last line without "\n"
    assert not last.ended


async def test_a_line_without_end_is_cut_at_the_bound_and_long_lines_are_whole() -> None:
    """A line that never ends grew the worker without bound (and was copied whole
    at every read); past MAX_SSE_LINE the stream is broken. A long line within it
    comes out whole, read in many small pieces."""
    long = b"x" * (1 << 20)
    pieces = [b"data: " + long[: 1 << 10]] + [
        long[i : i + 4096] for i in range(1 << 10, 1 << 20, 4096)
    ]
    response = LeanResponse(Pieces([*pieces, b"\n\ndata: [DONE]\n\n"]))  # type: ignore[arg-type]
    assert [p async for p in response.sse_data()] == [long]
    endless = [b"data: "] + [b"y" * (1 << 20)] * (MAX_SSE_LINE // (1 << 20) + 2)
    response = LeanResponse(Pieces(endless))  # type: ignore[arg-type]
    with pytest.raises(ResponseTooLarge, match="line is over"):
        async for _ in response.sse_data():
            pass


async def test_chunks_splitting_lines_midway(start: Start) -> None:
    pieces = [EVENTS[i : i + 5] for i in range(0, len(EVENTS), 5)]
    srv, client = await start(replies(chunked(*pieces)))
    assert await payloads(client) == [b'{"a":1}', b'{"b":2}']
    head = srv.seen[0].head
    assert head.startswith(b"POST /base/v1/chat HTTP/1.1\r\n")
    assert b"Content-Length: 7\r\n" in head
    assert srv.seen[0].body == b'{"x":1}'


async def test_content_length_body(start: Start) -> None:
    body = b'data: {"a":1}\n\ndata: [DONE]\n\n'
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    srv, client = await start(replies(head + body))
    assert await payloads(client) == [b'{"a":1}']
    assert await payloads(client) == [b'{"a":1}']
    assert [s.conn for s in srv.seen] == [0, 0]


async def test_keep_alive_reuses_one_connection(start: Start) -> None:
    srv, client = await start(replies(chunked(EVENTS)))
    for _ in range(3):
        assert await payloads(client) == [b'{"a":1}', b'{"b":2}']
    assert [s.conn for s in srv.seen] == [0, 0, 0]
    assert srv.connections == client.connects == 1


async def test_finished_stream_returns_to_pool_when_the_terminator_comes(start: Start) -> None:
    terminator = asyncio.Event()

    async def respond(seen: Seen, _r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(SSE_HEAD + chunk(EVENTS))
        await w.drain()
        if seen.conn == 0 and len(srv.seen) == 1:
            await terminator.wait()  # [DONE] is out; the chunked end comes later
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True

    srv, client = await start(respond)
    assert await payloads(client) == [b'{"a":1}', b'{"b":2}']  # does not wait for the end
    assert client._idle == []
    terminator.set()
    await until_true(lambda: client._idle != [], "the connection back in the pool")
    await payloads(client)
    assert [s.conn for s in srv.seen] == [0, 0]


async def test_terminator_that_never_comes_closes_the_connection(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lean_conn, "LINGER_S", 0.05)
    eof = asyncio.Event()

    async def respond(_s: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(SSE_HEAD + chunk(EVENTS))
        await w.drain()
        if await r.read() == b"":
            eof.set()
        return False

    _, client = await start(respond)
    assert await payloads(client) == [b'{"a":1}', b'{"b":2}']
    await asyncio.wait_for(eof.wait(), 10)
    assert client._idle == []


async def test_idle_connection_closed_by_server_then_a_fresh_one(start: Start) -> None:
    srv, client = await start(replies(chunked(EVENTS), keep=False))
    await payloads(client)
    await until_true(lambda: client._idle == [], "the client noticing the close")
    assert await payloads(client) == [b'{"a":1}', b'{"b":2}']
    assert [s.conn for s in srv.seen] == [0, 1]


async def test_stale_reused_connection_is_retried_once_on_a_fresh_one(start: Start) -> None:
    async def respond(seen: Seen, _r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if len([s for s in srv.seen if s.conn == seen.conn]) > 1:
            return False  # closes unanswered, as a server dropping an idle socket
        w.write(chunked(EVENTS))
        await w.drain()
        return True

    srv, client = await start(respond)
    await payloads(client)
    assert await payloads(client) == [b'{"a":1}', b'{"b":2}']
    assert [s.conn for s in srv.seen] == [0, 0, 1]
    assert client.connects == 2


async def test_fresh_connection_closed_unanswered_is_not_retried(start: Start) -> None:
    async def respond(*_: object) -> bool:
        return False

    srv, client = await start(respond)
    with pytest.raises(EngineUnavailable):
        await payloads(client)
    assert len(srv.seen) == 1


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [(400, EngineRejected, 400), (429, EngineRateLimited, 429), (503, EngineUnavailable, 503)],
)
async def test_error_status_maps_to_engine_errors(
    start: Start, status: int, kind: type[Exception], code: int
) -> None:
    srv, client = await start(replies(error(status, "nope"), chunked(EVENTS)))
    with pytest.raises(kind, match="nope") as info:
        await payloads(client)
    assert getattr(info.value, "status", None) == code
    assert await payloads(client) == [b'{"a":1}', b'{"b":2}']  # the socket was read clean
    assert [s.conn for s in srv.seen] == [0, 0]


async def test_broken_stream_and_unreachable_engine(start: Start) -> None:
    _, client = await start(replies(SSE_HEAD + chunk(b'data: {"a":1}\n\n'), keep=False))
    with pytest.raises(EngineStreamBroken):
        await payloads(client)
    with pytest.raises(EngineUnavailable, match="unreachable"):
        await payloads(LeanClient(f"http://127.0.0.1:{free_port()}"))


@pytest.mark.parametrize("how", ["stop iterating", "cancel the task"])
async def test_stopping_mid_stream_closes_the_socket(start: Start, how: str) -> None:
    eof = asyncio.Event()

    async def respond(_s: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(SSE_HEAD + chunk(b'data: {"a":1}\n\n'))
        await w.drain()
        if await r.read() == b"":  # the engine's view: the client went away
            eof.set()
        return False

    _, client = await start(respond)
    first = asyncio.Event()

    async def consume() -> None:
        async with client.stream("/v1/chat", b"{}", {}) as response:
            async for _ in response.sse_data():
                first.set()
                if how == "stop iterating":
                    return

    task = asyncio.create_task(consume())
    await first.wait()
    if how == "cancel the task":
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert all(c.closed for c in client._all)  # at once, not after a linger
    assert client._idle == []
    await asyncio.wait_for(eof.wait(), 10)


async def test_connections_are_bounded(start: Start) -> None:
    gate = asyncio.Event()

    async def respond(_s: Seen, _r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        await gate.wait()
        w.write(chunked(EVENTS))
        await w.drain()
        return True

    srv, client = await start(respond)  # max_connections=4
    calls = [asyncio.create_task(payloads(client)) for _ in range(6)]
    await until_true(lambda: len(srv.seen) == 4, "four requests in flight")
    assert srv.connections == 4
    gate.set()
    await asyncio.gather(*calls)
    assert srv.connections == 4


async def test_adapter_sends_key_request_id_and_headers(start: Start) -> None:
    sse = (
        b'data: {"model":"m","choices":[{"delta":{"content":"hi"}}]}\n\n'
        b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
        b"data: [DONE]\n\n"
    )
    srv, client = await start(replies(chunked(sse)))
    async with OpenAIAdapter(f"http://127.0.0.1:{client._port}/base", api_key="sk-1") as adapter:
        assert adapter._lean is not None
        body = {"model": "m", "messages": []}
        events = [e async for e in adapter.generate("chat", body, "req-7", {"traceparent": "t"})]
        with pytest.raises(EngineRejected):
            [e async for e in adapter.generate("chat", body, "r", {"X-Bad": "a\r\nInjected: 1"})]
    assert events[0] == Delta("hi")
    assert isinstance(events[-1], Done)
    assert (events[-1].finish_reason, events[-1].model) == ("stop", "m")
    assert events[-1].usage.prompt_tokens == 3
    head = srv.seen[0].head
    for line in (b"Authorization: Bearer sk-1", b"X-Request-Id: req-7", b"traceparent: t"):
        assert line + b"\r\n" in head
    assert b'"stream":true' in srv.seen[0].body
    assert len(srv.seen) == 1  # the bad header never left the worker


async def test_https_stays_on_httpx() -> None:
    with pytest.raises(ValueError, match="http://"):
        LeanClient("https://engine:443")
    async with OpenAIAdapter("https://engine:443") as adapter:
        assert adapter._lean is None


@pytest.mark.parametrize(
    "scenario",
    [
        test_chunks_splitting_lines_midway,
        test_keep_alive_reuses_one_connection,
        test_finished_stream_returns_to_pool_when_the_terminator_comes,
        test_stale_reused_connection_is_retried_once_on_a_fresh_one,
        test_broken_stream_and_unreachable_engine,
        functools.partial(test_stopping_mid_stream_closes_the_socket, how="stop iterating"),
        functools.partial(test_stopping_mid_stream_closes_the_socket, how="cancel the task"),
    ],
    ids=lambda f: getattr(f, "__name__", "stopping_mid_stream"),
)
def test_on_uvloop(scenario: Callable[[Start], Awaitable[None]]) -> None:
    """The worker runs on uvloop, whose transports are not asyncio's."""

    async def run() -> None:
        async with servers() as make:
            await scenario(make)

    uvloop.run(run())


def test_an_in_band_errors_status_comes_from_its_code_or_its_type() -> None:
    """vLLM's int code; a proxy's code as a string (LiteLLM's "400"); an OpenAI
    error's type when its code is a name. A string code read as no status made a
    client's error a broken stream: retried once, then a 502."""
    assert _status_of({"code": 400}) == 400
    assert _status_of({"code": "400"}) == 400
    assert _status_of({"code": "context_length_exceeded", "type": "invalid_request_error"}) == 400
    assert _status_of({"code": "rate_limited", "type": "rate_limit_error"}) == 429
    assert _status_of({"code": "stream_interrupted", "type": "server_error"}) is None
    assert _status_of({"message": "boom"}) is None


def whole(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "httpx"])
async def test_engine_reads_are_bounded_before_decoding(start: Start, lean: bool) -> None:
    """An engine (broken, or not the one configured) could grow a worker without
    bound: httpx's lines and whole-body reads kept everything until the end, and
    so did the lean client's whole reads. Every path now stops at its bound: a
    stream line (MAX_SSE_LINE), an answer (MAX_BODY), an error body (cut to
    MAX_ERROR_BODY, its message to 4096 characters)."""
    endless = chunked(b"data: " + b"y" * (MAX_SSE_LINE + 1))  # one line, never ended
    huge = whole(200, b'{"data":[],"pad":"' + b"z" * MAX_BODY + b'"}')
    noisy = whole(400, b'{"error":{"message":"' + b"m" * (1 << 20) + b'","type":"x"}}')
    _, client = await start(replies(endless, huge, noisy))
    url = f"http://127.0.0.1:{client._port}/base"
    async with OpenAIAdapter(url, lean_streams=lean) as adapter:
        assert (adapter._lean is not None) is lean
        with pytest.raises(ResponseTooLarge, match="line is over"):
            [e async for e in adapter.generate("chat", {"model": "m"}, "r1", {})]
        with pytest.raises(ResponseTooLarge, match="answer is over"):
            await adapter.embed({"model": "m", "input": ["a"]}, "r2", {})
        with pytest.raises(EngineRejected) as rejected:
            await adapter.embed({"model": "m", "input": ["a"]}, "r3", {})
        assert rejected.value.status == 400
        assert 0 < len(str(rejected.value)) <= 4096


async def test_httpx_lines_match_the_lean_reader_at_every_split(start: Start) -> None:
    """The httpx path (https engines) reads SSE lines as the lean client does, with
    CR, LF and CRLF ends, wherever the body is split."""
    sse = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\r\n\r\n: c\rdata: ' + (
        b'{"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    answers = [chunked(sse[:cut], sse[cut:]) for cut in range(1, len(sse))]
    _, client = await start(replies(*answers))
    url = f"http://127.0.0.1:{client._port}/base"
    async with OpenAIAdapter(url, lean_streams=False) as adapter:
        for cut in range(1, len(sse)):
            events = [e async for e in adapter.generate("chat", {"model": "m"}, "r", {})]
            deltas = [e.text for e in events if isinstance(e, Delta)]
            assert deltas == ["a", "b"], cut
            done = events[-1]
            assert isinstance(done, Done), cut
            assert done.finish_reason == "stop", cut

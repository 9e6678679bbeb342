"""The streaming OpenAI client: sends one request and records its timeline.

Connections come from several small httpx pools rather than one big one: one
AsyncClient with hundreds of connections serialises requests client-side (measured:
1000 requests took 35 s through one 400-connection pool and 1.4 s through 100 clients
of 10 connections each), which would make the generator the bottleneck.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
import msgspec

from jetserve.bench.timeline import Outcome, Timeline
from jetserve.bench.workload import RequestSpec

Clock = Callable[[], float]


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None  # /v1/completions
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _carries_output(choice: _Choice) -> bool:
    # The first token, not the role chunk: some servers send {"role": ..., "content": ""}
    # before any token is generated (vLLM sends it with the first token).
    d = choice.delta
    if d is not None and (d.content or d.reasoning_content or d.tool_calls):
        return True
    return bool(choice.text)


def classify(status: int) -> Outcome:
    if status in (429, 503):
        return "rejected"
    if status in (408, 504):
        return "timeout"
    return "error"


def _error_text(payload: object, fallback: str) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or err.get("message") or fallback)[:80]
        return str(err)[:80]
    return fallback


class ClientPool:
    """httpx clients of `conns` connections each, grown on demand up to `max_clients`.

    A request takes a slot on the first client with a free one, so no request waits
    in an httpx pool queue while another client could send it at once.
    """

    def __init__(
        self,
        conns: int = 10,
        max_clients: int = 200,
        connect_timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: an in-memory server
    ) -> None:
        if conns < 1 or max_clients < 1:
            raise ValueError("conns and max_clients must be >= 1")
        self.conns = conns
        self.max_clients = max_clients
        self._connect_timeout = connect_timeout
        self._transport = transport
        # One TLS context for all: building one per client costs milliseconds each.
        self._ssl = ssl.create_default_context()
        self._clients: list[httpx.AsyncClient] = []
        self._busy: list[int] = []

    def _new(self) -> int:
        self._clients.append(
            httpx.AsyncClient(
                limits=httpx.Limits(
                    max_connections=self.conns, max_keepalive_connections=self.conns
                ),
                # Reads wait as long as the request's own deadline allows (asyncio.timeout).
                timeout=httpx.Timeout(
                    connect=self._connect_timeout, read=None, write=30, pool=None
                ),
                verify=self._ssl,
                trust_env=False,  # a benchmark goes straight to its target, not via env proxies
                transport=self._transport,
            )
        )
        self._busy.append(0)
        return len(self._clients) - 1

    def prestart(self, n: int) -> None:
        while len(self._clients) < min(n, self.max_clients):
            self._new()

    @property
    def size(self) -> int:
        return len(self._clients)

    def acquire(self) -> int:
        for i, busy in enumerate(self._busy):
            if busy < self.conns:
                self._busy[i] += 1
                return i
        i = self._new() if len(self._clients) < self.max_clients else self._least_busy()
        self._busy[i] += 1
        return i

    def _least_busy(self) -> int:
        return min(range(len(self._busy)), key=self._busy.__getitem__)

    def release(self, i: int) -> None:
        self._busy[i] -= 1

    def client(self, i: int) -> httpx.AsyncClient:
        return self._clients[i]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients), return_exceptions=True)
        self._clients.clear()
        self._busy.clear()


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    headers: Mapping[str, str],
    body: bytes,
    req: RequestSpec,
    *,
    t0: float,
    deadline: float,
    clock: Clock = time.perf_counter,
) -> Timeline:
    """Send `body`, read the SSE stream, and time it. `t0` is the run start and
    `deadline` the latest end, both on `clock`; the request is also cut at its
    workload cancel-after."""
    sent = clock()
    cancel_at = sent + req.cancel_after if req.cancel_after is not None else math.inf
    stop_at = min(cancel_at, deadline)
    status = 0
    outcome: Outcome = "error"
    error = ""
    ttft: float | None = None
    chunks: list[float] = []
    usage: _Usage | None = None
    end = sent
    timed = False  # the whole stream was read and timed: what follows cannot fail it
    try:
        async with asyncio.timeout(max(stop_at - sent, 0.0)) as scope:
            request = client.build_request("POST", url, content=body, headers=headers)
            response = await client.send(request, stream=True)
            try:
                status = response.status_code
                if status >= 400:
                    raw = await response.aread()
                    outcome = classify(status)
                    try:
                        error = _error_text(msgspec.json.decode(raw), f"http {status}")
                    except msgspec.DecodeError:
                        error = f"http {status}"
                else:
                    lines = response.aiter_lines()
                    outcome, error, usage = await _read_stream(lines, sent, chunks, clock)
                end = clock()  # before closing: the stream's end is what e2e measures
                if outcome == "ok":
                    timed = True
                    await _read_to_end(lines, scope)
            finally:
                await response.aclose()
    except TimeoutError:
        # When `timed`, only the body's end did not come within DRAIN_S: the stream
        # stands as read, and the connection is closed instead of kept.
        if not timed:
            end = clock()
            if cancel_at <= deadline and end >= cancel_at - 0.002:
                outcome, error = "cancelled", ""
            else:
                outcome, error = "timeout", "client deadline"
    except httpx.HTTPError as exc:
        if not timed:
            end = clock()
            outcome, error = "error", type(exc).__name__
    if chunks:
        ttft = chunks[0]
    details = usage.prompt_tokens_details if usage is not None else None
    return Timeline(
        index=req.index,
        cls=req.cls,
        scheduled=req.at,
        sent=sent - t0,
        end=end - t0,
        outcome=outcome,
        status=status,
        error=error,
        ttft=ttft,
        chunks=chunks,
        e2e=(end - sent) if outcome == "ok" else None,
        output_tokens=usage.completion_tokens if usage is not None else None,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        cached_tokens=details.cached_tokens if details is not None else None,
    )


DRAIN_S = 0.05  # after [DONE], how long the rest of the body (its chunked end) may take


async def _read_to_end(lines: AsyncIterator[str], scope: asyncio.Timeout) -> None:
    """Read what follows [DONE] (normally only the chunked body's end) once the
    stream's end was timed: a body left unread makes httpx close the connection
    instead of keeping it for the next request (every request paid a new TCP
    connect). The request's own deadline is brought forward to DRAIN_S from now, so
    a server that holds the stream open after [DONE] gets its connection closed, as
    before, and put back before the response is closed: no second timeout nested in
    the request's, and none due while httpcore releases the connection."""
    when = scope.when()
    soon = asyncio.get_running_loop().time() + DRAIN_S
    scope.reschedule(soon if when is None else min(when, soon))
    async for _ in lines:
        pass
    scope.reschedule(when)


async def _read_stream(
    lines: AsyncIterator[str], sent: float, chunks: list[float], clock: Clock
) -> tuple[Outcome, str, _Usage | None]:
    usage: _Usage | None = None
    finished = False
    async for line in lines:
        now = clock()
        if not line.startswith("data:"):
            continue  # blank separators, `: keep-alive` comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            finished = True
            break
        try:
            chunk = _decode_chunk(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "error", "malformed chunk", usage
        if chunk.error is not None:
            return "error", _error_text({"error": chunk.error}, "stream error"), usage
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices or ():
            if _carries_output(choice):
                chunks.append(now - sent)
                break
        if any(c.finish_reason for c in chunk.choices or ()):
            finished = True
    if not chunks:
        return "error", "no output", usage
    if not finished and usage is None:
        return "error", "stream ended early", usage
    return "ok", "", usage

"""Server-sent events in OpenAI's wire format, and a response that races the
stream against client disconnect so the upstream is cancelled at once (not at
the next write, which may be many seconds away on a stalled stream)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import ClientTooSlow, GatewayError
from gateway.inference.dispatch import error_from_frame
from gateway.inference.event_ids import ROLE_ID, content_id, finish_id, usage_id
from gateway.inference.openai_types import ChunkWriter, merge_logprobs
from gateway.inference.service import InferenceService
from gateway.inference.sessions import Session
from streams.inference.frames import Event
from streams.wire import ErrorFrame, Token

_encoder = msgspec.json.Encoder()
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The HTTP client disconnected before the response was committed."""


async def race_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client disconnects first (then ClientGone)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone


# What ``on_disconnect`` hears when the response never started: the client has no
# X-Request-Id, so there is nothing it could resume.
NOT_STARTED = "not_started"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_disconnect: Callable[[str], Awaitable[None]],
        headers: dict[str, str],
        abort: asyncio.Event | None = None,
    ) -> None:
        self._body = body
        self._on_disconnect = on_disconnect
        self._abort = abort  # set: end the response now (a client too slow to keep up)
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def _pump(self, send: Send) -> None:
        async for chunk in self._body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        except BaseException:
            # Never started: the body was not read, so only this ends what it holds.
            await self._on_disconnect(NOT_STARTED)
            raise
        pump = asyncio.ensure_future(self._pump(send))
        listener = asyncio.ensure_future(wait_disconnect(receive))
        watchers: set[asyncio.Future[Any]] = {pump, listener}
        aborter = asyncio.ensure_future(self._abort.wait()) if self._abort else None
        if aborter is not None:
            watchers.add(aborter)
        try:
            await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            if aborter is not None:
                aborter.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
                too_slow = self._abort is not None and self._abort.is_set()
                await self._on_disconnect("client_too_slow" if too_slow else "client_disconnected")
                if too_slow:
                    # The blocked write was abandoned mid-body: the server closes
                    # the connection, which is the only signal left to give.
                    raise ClientTooSlow("The client read the stream too slowly; it was ended.")
        if not pump.cancelled() and (exc := pump.exception()) is not None:
            # The write failed (OSError: the client is gone; RuntimeError: the
            # connection was closed under the response) or anything else did: the
            # request still ends in one recorded outcome, then a non-OSError is raised.
            await self._on_disconnect("client_disconnected")
            if isinstance(exc, OSError):
                return
            raise exc


def ender(gw: InferenceService, session: Session) -> Callable[[str], Awaitable[None]]:
    """An inference stream's ``on_disconnect``: the session abandoned, resumable
    unless its response never started."""

    async def end(reason: str) -> None:
        if reason == NOT_STARTED:
            await gw.abandon(session, "client_disconnected", may_resume=False)
        else:
            await gw.abandon(session, reason)

    return end


class ClientEvent(NamedTuple):
    kind: str  # "chunk" | "error" | "keepalive" | "done"
    payload: dict[str, Any] | None = None
    status: int = 200  # for "error": the status the failure maps to
    # For "chunk": its unique, increasing event id (gateway/inference/event_ids.py),
    # the SSE ``id:`` a client resumes after. 0 for the events that end a response.
    event_id: int = 0


async def client_events(
    gw: InferenceService, adm: Session, first: Event | None
) -> AsyncGenerator[ClientEvent, None]:
    """OpenAI chunks for one streaming request, for any transport (SSE, WebSocket).

    ``first`` is the event that committed the response (None: committed by the
    keep-alive timer). Records the request's terminal outcome. A resumed session
    yields only the chunks after its ``last_event_id``: the reader skips the tokens
    the client has, and the role, closing and usage chunks are skipped here by id.
    """
    writer = ChunkWriter(adm.op, adm.request_id, adm.model, adm.created)
    stream = adm.stream
    after = adm.last_event_id
    writer.role_sent = after >= ROLE_ID  # a resume past the role chunk
    finished: set[int] = set()  # choices whose finish reason went out on a token
    seen: set[int] = set()
    event = first
    try:
        while True:
            if event is None:
                try:
                    event = await stream.next_event(gw.cfg.heartbeat_timeout_s, gw.cfg.keepalive_s)
                except TimeoutError:
                    yield ClientEvent("keepalive")
                    continue
            if isinstance(event, Token):
                # Coalesce whatever is already buffered into one write per choice
                # (slow clients); each run of one choice's tokens is a chunk.
                batch = [event, *stream.drain_tokens()]
                adm.tokens_seen += len(batch)
                for chunk in _token_chunks(writer, batch, seen, finished):
                    yield chunk
                event = None
                continue
            if isinstance(event, ErrorFrame):
                raise error_from_frame(event)
            # A token the resumed client already has may have carried the reason.
            if stream.skipped_finish is not None:
                finished.add(0)
            # Answered: decided before the client can see the end (a client that
            # leaves after the last chunk leaves an answered request), recorded
            # while the last chunks go out, and before [DONE].
            recording = gw.decide(adm, "ok", 200, event)
            unfinished = sorted((set(range(adm.choices)) | seen) - finished)
            if unfinished and finish_id(event.seq) > after:
                closing = writer.finish(event.finish_reason, unfinished)
                yield ClientEvent("chunk", closing, event_id=finish_id(event.seq))
            if adm.include_usage and usage_id(event.seq) > after:
                usage = writer.usage(event.usage)
                yield ClientEvent("chunk", usage, event_id=usage_id(event.seq))
            if recording is not None:
                await asyncio.shield(recording)
            yield ClientEvent("done")
            return
    except GatewayError as exc:  # StreamInterrupted included
        await gw.fail(adm, exc)
        yield ClientEvent("error", exc.body(), exc.status)


def _token_chunks(
    writer: ChunkWriter, batch: list[Token], seen: set[int], finished: set[int]
) -> Iterator[ClientEvent]:
    """One chunk per run of one choice's tokens in ``batch`` (its text, tool calls,
    logprobs and finish reason merged), noting the choices seen and finished."""
    for index, run in itertools.groupby(batch, key=lambda t: t.index):
        group = list(run)
        seen.add(index)
        text = "".join(t.text for t in group)
        calls = [c for t in group if t.tool_calls for c in t.tool_calls] or None
        finish = next((t.finish_reason for t in reversed(group) if t.finish_reason), None)
        if finish is not None:
            finished.add(index)
        logprobs = merge_logprobs([t.logprobs for t in group])
        thought = "".join(t.reasoning for t in group if t.reasoning) or None
        *roles, content = writer.delta(text, calls, finish, logprobs, index, thought)
        for role in roles:  # the chat role chunk, before the first token
            yield ClientEvent("chunk", role, event_id=ROLE_ID)
        yield ClientEvent("chunk", content, event_id=content_id(group[-1].seq))


async def sse_body(events: AsyncIterator[ClientEvent]) -> AsyncIterator[bytes]:
    async for kind, payload, _, event_id in events:
        if kind == "keepalive":
            yield KEEPALIVE
        elif kind == "done":
            yield DONE
        else:
            assert payload is not None
            # A client that reconnects with this id as Last-Event-ID gets
            # exactly the events after it (gateway/inference/event_ids.py).
            yield (b"id: %d\n" % event_id if event_id else b"") + sse(payload)

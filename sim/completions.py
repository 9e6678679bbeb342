"""Serving a planned reply: drive the engine token by token, render vLLM's wire shapes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.types import Send

from sim import logprobs as lp
from sim import outbound as out
from sim.engine import Sequence
from sim.faults import Fault, FaultKind
from sim.planning import Event, Plan, Text, Thought, ToolArgs, ToolStart, event_token
from sim.records import RequestRecord
from sim.responses import Dropped, GuardedResponse
from sim.simulator import Simulator

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class Job(msgspec.Struct, kw_only=True):
    chat: bool
    response_id: str
    model: str
    created: int
    prompt_ids: list[int]
    events: list[Event]
    natural_finish: str  # "stop", or "tool_calls" for a scripted tool-call reply
    max_tokens: int
    stops: list[str]
    stream: bool
    include_usage: bool
    fault: Fault | None
    record: RequestRecord
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    more_choices: list[list[Event]] = []  # choices 1..n-1 (``n`` > 1)
    echo: str = ""  # ``echo``: the prompt, ahead of each choice's text
    cache_salt: str = ""  # the prefix cache is reused only within one salt

    @property
    def choices(self) -> list[list[Event]]:
        return [self.events, *self.more_choices]


class StopScanner:
    """Cuts text at the first stop string; holds back a tail that could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.matched = best[1]
            return self.flush()
        safe = len(self.text) - self.hold
        if safe <= self.sent:
            return ""
        delta = self.text[self.sent : safe]
        self.sent = safe
        return delta

    def flush(self) -> str:
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta


# -- running -------------------------------------------------------------------------


def start(sim: Simulator, job: Job) -> GuardedResponse:
    """The response that queues the request in the engine and serves its tokens."""

    async def body(send: Send) -> None:
        seq = sim.engine.add(job.record, job.prompt_ids, job.fault, job.cache_salt)
        try:
            if job.stream:
                await _stream(sim, seq, job, send)
            else:
                await _complete(sim, seq, job, send)
        except asyncio.CancelledError:
            sim.engine.abort(seq)  # the client went away: stop generating, free KV
            raise
        except Dropped:
            sim.engine.fail(seq, "drop")
            raise
        except Exception:
            sim.engine.fail(seq, "error")
            raise

    return GuardedResponse(body)


class Logprobs:
    """The logprobs of the tokens generated since the last emitted chunk (None:
    the request asked for none), rendered in the request's API shape."""

    def __init__(self, job: Job) -> None:
        self.top = job.logprobs
        self.chat = job.chat
        self.pending: list[lp.TokenLogprob] = []
        self.sent_chars = 0  # the completions shape's text offsets

    def add(self, piece: str, position: int) -> None:
        if self.top is not None:
            self.pending.append(lp.TokenLogprob(piece, position, self.top))

    def take(self) -> dict[str, Any] | None:
        """What is pending, for the chunk about to go out."""
        if self.top is None or not self.pending:
            return None
        entries, self.pending = self.pending, []
        if self.chat:
            return lp.chat(entries)
        body = lp.completion(entries, self.sent_chars)
        self.sent_chars += sum(len(e.token) for e in entries)
        return body


def _drop_at(job: Job) -> int | None:
    f = job.fault
    return f.arg if f is not None and f.kind is FaultKind.DROP else None


def _usage(seq: Sequence, job: Job) -> out.Usage:
    return out.usage(len(job.prompt_ids), seq.generated, job.record.cached_tokens)


def _chat_chunk(
    job: Job,
    delta: out.ChatDelta,
    finish: str | None = None,
    stop: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> out.ChatChunk:
    choice = out.ChatChunkChoice(
        index=index, delta=delta, finish_reason=finish, stop_reason=stop, logprobs=logprobs
    )
    return out.ChatChunk(
        id=job.response_id,
        object="chat.completion.chunk",
        created=job.created,
        model=job.model,
        choices=[choice],
    )


def _text_chunk(
    job: Job,
    text: str,
    finish: str | None = None,
    stop: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> out.CompletionChunk:
    choice = out.CompletionChoice(
        index=index, text=text, finish_reason=finish, stop_reason=stop, logprobs=logprobs
    )
    return out.CompletionChunk(
        id=job.response_id,
        object="text_completion",
        created=job.created,
        model=job.model,
        choices=[choice],
    )


def _usage_chunk(job: Job, usage: out.Usage) -> out.ChatChunk | out.CompletionChunk:
    """The closing chunk of ``stream_options.include_usage``: no choices."""
    if job.chat:
        return out.ChatChunk(
            id=job.response_id,
            object="chat.completion.chunk",
            created=job.created,
            model=job.model,
            choices=[],
            usage=usage,
        )
    return out.CompletionChunk(
        id=job.response_id,
        object="text_completion",
        created=job.created,
        model=job.model,
        choices=[],
        usage=usage,
    )


def _tool_delta(ev: ToolStart | ToolArgs) -> out.ToolCallDelta:
    if isinstance(ev, ToolStart):
        return out.ToolCallDelta(
            index=ev.index,
            id=ev.id,
            type="function",
            function=out.FunctionDelta(name=ev.name, arguments=""),
        )
    return out.ToolCallDelta(index=ev.index, function=out.FunctionDelta(arguments=ev.piece))


class _Choice:
    """One of the request's ``n`` choices as it is generated: its events, stop
    scanner and logprobs, and the chunks each token makes."""

    def __init__(self, job: Job, index: int, events: list[Event]) -> None:
        self.job = job
        self.index = index
        self.events = events
        self.num = min(len(events), job.max_tokens)
        self.scanner = StopScanner(job.stops)
        self.logprobs = Logprobs(job)
        self.finish: str | None = None
        natural = job.natural_finish if index == 0 else "stop"
        self.reason = "length" if len(events) > job.max_tokens else natural
        self.calls: dict[int, tuple[str, str, list[str]]] = {}
        self.reasoning: list[str] = []

    def live(self, i: int) -> bool:
        return self.finish is None and i < self.num

    def step(self, i: int, ev: Event) -> list[object]:
        """The stream chunks token ``i`` makes (none while a stop string may start)."""
        job, final = self.job, i == self.num - 1
        if isinstance(ev, Thought):
            self.finish = self.reason if final else None
            if not job.chat:
                return []  # completions have no reasoning field
            d = out.ChatDelta(reasoning_content=ev.piece)
            return [_chat_chunk(job, d, self.finish, index=self.index)]
        if isinstance(ev, Text):
            self.logprobs.add(ev.piece, i)
            delta = self.scanner.push(ev.piece)
            if self.scanner.matched is not None:
                self.finish = "stop"
            elif final:
                delta += self.scanner.flush()
                self.finish = self.reason
            if not (delta or self.finish):
                return []
            lps = self.logprobs.take()
            if job.chat:
                d = out.ChatDelta(content=delta)
                return [_chat_chunk(job, d, self.finish, self.scanner.matched, lps, self.index)]
            return [_text_chunk(job, delta, self.finish, self.scanner.matched, lps, self.index)]
        chunks: list[object] = []
        held = self.scanner.flush()
        if held:
            d = out.ChatDelta(content=held)
            chunks.append(_chat_chunk(job, d, logprobs=self.logprobs.take(), index=self.index))
        self.finish = self.reason if final else None
        d = out.ChatDelta(tool_calls=[_tool_delta(ev)])
        chunks.append(_chat_chunk(job, d, self.finish, index=self.index))
        return chunks

    def collect(self, i: int, ev: Event) -> None:
        """Token ``i`` of a whole (non-streamed) reply."""
        if isinstance(ev, Thought):
            self.reasoning.append(ev.piece)
        elif isinstance(ev, Text):
            self.logprobs.add(ev.piece, i)
            self.scanner.push(ev.piece)
            if self.scanner.matched is not None:
                self.finish = "stop"
        elif isinstance(ev, ToolStart):
            self.calls[ev.index] = (ev.id, ev.name, [])
        else:
            self.calls[ev.index][2].append(ev.piece)
        if self.finish is None and i == self.num - 1:
            self.finish = self.reason

    def whole(self) -> out.ChatChoice | out.CompletionChoice:
        text, finish = self.job.echo + self.scanner.text, self.finish or self.reason
        if not self.job.chat:
            return out.CompletionChoice(
                index=self.index,
                text=text,
                finish_reason=finish,
                stop_reason=self.scanner.matched,
                logprobs=self.logprobs.take(),
            )
        tool_calls = [
            out.ToolCall(id=cid, function=out.FunctionCall(name=name, arguments="".join(args)))
            for cid, name, args in self.calls.values()
        ]
        message = out.AssistantMessage(
            content=None if (tool_calls and not text) else text,
            tool_calls=tool_calls,
            reasoning_content="".join(self.reasoning) if self.reasoning else msgspec.UNSET,
        )
        return out.ChatChoice(
            index=self.index,
            message=message,
            finish_reason=finish,
            stop_reason=self.scanner.matched,
            logprobs=self.logprobs.take(),
        )


async def _tokens(
    sim: Simulator, seq: Sequence, job: Job, choices: list[_Choice]
) -> AsyncIterator[tuple[int, _Choice, Event]]:
    """Every choice's tokens through the engine: token ``i`` of every live choice
    comes out of one step, as vLLM's ``n`` sequences decode side by side."""
    drop_at = _drop_at(job)
    for i in range(max(c.num for c in choices)):
        if drop_at is not None and i == drop_at:
            raise Dropped
        live = [c for c in choices if c.live(i)]
        if not live:
            break
        await sim.engine.next_tokens(seq, [event_token(sim, c.events[i]) for c in live])
        for choice in live:
            yield i, choice, choice.events[i]


async def _stream(sim: Simulator, seq: Sequence, job: Job, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _headers(job)})

    async def emit(chunk: object) -> None:
        await send({"type": "http.response.body", "body": out.sse(chunk), "more_body": True})

    choices = [_Choice(job, j, events) for j, events in enumerate(job.choices)]
    async for i, choice, ev in _tokens(sim, seq, job, choices):
        if i == 0 and job.chat:
            # Like vLLM: headers go out at once, the role chunk with the first token.
            role = out.ChatDelta(role="assistant", content="")
            await emit(_chat_chunk(job, role, index=choice.index))
        elif i == 0 and job.echo:
            await emit(_text_chunk(job, job.echo, index=choice.index))  # the prompt first
        for chunk in choice.step(i, ev):
            await emit(chunk)
    sim.engine.finish(seq, _engine_reason(choices[0].finish or choices[0].reason))
    if job.include_usage:
        await emit(_usage_chunk(job, _usage(seq, job)))
    await send({"type": "http.response.body", "body": out.DONE, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _complete(sim: Simulator, seq: Sequence, job: Job, send: Send) -> None:
    choices = [_Choice(job, j, events) for j, events in enumerate(job.choices)]
    async for i, choice, ev in _tokens(sim, seq, job, choices):
        choice.collect(i, ev)
    sim.engine.finish(seq, _engine_reason(choices[0].finish or choices[0].reason))
    usage = _usage(seq, job)
    body: object
    whole = [c.whole() for c in choices]
    if job.chat:
        body = out.ChatCompletion(
            id=job.response_id,
            created=job.created,
            model=job.model,
            usage=usage,
            choices=[c for c in whole if isinstance(c, out.ChatChoice)],
        )
    else:
        body = out.Completion(
            id=job.response_id,
            created=job.created,
            model=job.model,
            usage=usage,
            choices=[c for c in whole if isinstance(c, out.CompletionChoice)],
        )
    payload = msgspec.json.encode(body)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"x-request-id", job.record.id.encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _engine_reason(finish: str) -> str:
    # vLLM's request_success label knows stop/length/abort; a tool call is a stop.
    return "stop" if finish == "tool_calls" else finish


def _headers(job: Job) -> list[tuple[bytes, bytes]]:
    return [*SSE_HEADERS, (b"x-request-id", job.record.id.encode())]


def new_job(
    sim: Simulator, plan: Plan, *, chat: bool, request_id: str, model: str, fault: Fault | None
) -> Job:
    """Check the context length, then record the request: it is about to be served."""
    max_tokens = sim.check_length(len(plan.prompt_ids), plan.max_tokens)
    record = sim.new_record(request_id, "chat" if chat else "completions", fault)
    return Job(
        chat=chat,
        response_id=("chatcmpl-" if chat else "cmpl-") + request_id,
        model=model,
        created=int(time.time()),
        prompt_ids=plan.prompt_ids,
        events=plan.events,
        natural_finish=plan.natural_finish,
        max_tokens=max_tokens,
        stops=plan.stops,
        stream=plan.stream,
        include_usage=plan.include_usage,
        fault=fault,
        record=record,
        logprobs=plan.logprobs,
        more_choices=plan.more_choices,
        echo=plan.echo,
        cache_salt=plan.cache_salt,
    )

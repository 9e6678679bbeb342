"""What the TGI and Triton surfaces share: planning a reply from a bare prompt,
driving the engine token by token, and the raw ASGI response pieces."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.types import Send

from sim import structured
from sim.completions import SSE_HEADERS, StopScanner
from sim.dialects.choices import DialectError, Spec, natural, pad, sequence_seeds
from sim.faults import Fault, FaultKind
from sim.inbound import ApiError, ScriptedResponse
from sim.responses import Dropped
from sim.scripts import Conversation, parse_response
from sim.simulator import Simulator

JSON = "application/json"
OVERLOADED = "Model is overloaded"
QUEUE_FULL = "Exceeds maximum queue size"
UNAVAILABLE = "The engine is overloaded or restarting (simulated)."
INTERNAL = "Internal server error (simulated)."

T = TypeVar("T")


def sse(obj: object) -> bytes:
    return b"data:" + msgspec.json.encode(obj) + b"\n\n"


def _tool_text(resp: ScriptedResponse) -> str:
    """A scripted reply as a Hermes-style tool-calling model writes it."""
    text = resp.content or ""
    for call in resp.tool_calls or []:
        args = call.function.get("arguments", {})
        parsed = json.loads(args) if isinstance(args, str) and args else args
        payload = json.dumps({"name": call.function.get("name", ""), "arguments": parsed})
        text += f"<tool_call>\n{payload}\n</tool_call>"
    return text


class Reply(msgspec.Struct, kw_only=True):
    """What one dialect request will produce: the prompt and each sequence's pieces."""

    prompt_ids: list[int]
    choices: list[list[str]]
    max_tokens: int
    stops: list[str]
    fault: Fault | None


def plan(
    sim: Simulator,
    request: Request,
    prompt: str,
    max_tokens: int | None,
    stops: list[str],
    s: Spec,
    fault: Fault | None,
) -> Reply:
    prompt_ids = sim.tokenizer.encode(prompt)
    try:
        limit = sim.check_length(len(prompt_ids), max_tokens)
    except ApiError as e:
        raise DialectError(422, e.message) from None
    header = request.headers.get("x-sim-script")
    conv = Conversation(last_user=prompt, last_role="user", prompt=prompt)
    try:
        script = parse_response(header) if header is not None else sim.scripts.pick(conv)
    except ApiError as e:
        raise DialectError(422, e.message) from None
    # ignore_eos: no end of sequence before max_tokens, so the reply ends "length".
    forced = max_tokens + 1 if s.ignore_eos and max_tokens is not None else None
    fixed: list[str] | None = None
    if script is not None:
        sim.stats.scripted += 1
        fixed = sim.tokenizer.pieces(_tool_text(script)) or [""]
    elif s.target is not None:
        fixed = sim.tokenizer.pieces(structured.render(s.target, sum(prompt_ids)))
    if fixed is not None:
        fixed = pad(sim, prompt_ids, fixed, forced or s.knobs.min_tokens, s)
        choices = [list(fixed) for _ in range(s.n)]
    else:
        choices = [natural(sim, prompt_ids, s, seed, forced) for seed in sequence_seeds(s)]
    return Reply(prompt_ids=prompt_ids, choices=choices, max_tokens=limit, stops=stops, fault=fault)


def _arg(fault: Fault | None, kind: FaultKind) -> int | None:
    return fault.arg if fault is not None and fault.kind is kind else None


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """Token ``i`` of sequence ``index``: the text it releases (``delta``), the token
    itself (``piece``), the sequence's tokens so far, and its finish reason if last."""

    index: int
    i: int
    delta: str
    piece: str
    tokens: int
    reason: str | None


Emit = Callable[[Step], Awaitable[None]]
AfterStep = Callable[[int], Awaitable[None]]


class _Sequence:
    def __init__(self, index: int, pieces: list[str], reply: Reply, keep_stop: bool) -> None:
        self.index, self.pieces, self.keep_stop = index, pieces, keep_stop
        self.stops = reply.stops
        self.num = min(len(pieces), reply.max_tokens)
        self.finish = "length" if len(pieces) > reply.max_tokens else "stop"
        self.scanner = StopScanner([] if keep_stop else reply.stops)
        self.text = ""
        self.done: str | None = None

    def step(self, i: int) -> Step:
        piece = self.pieces[i]
        if self.keep_stop:
            self.text += piece
            hit = any(s in self.text for s in self.stops)
            delta = piece
        else:
            delta = self.scanner.push(piece)
            hit = self.scanner.matched is not None
        last = hit or i == self.num - 1
        if last:
            self.done = "stop_sequence" if hit else self.finish
            if not self.keep_stop:
                delta += self.scanner.flush()
        return Step(index=self.index, i=i, delta=delta, piece=piece, tokens=i + 1, reason=self.done)


async def generate(
    sim: Simulator,
    reply: Reply,
    rec_id: str,
    endpoint: str,
    emit: Emit,
    keep_stop: bool,
    send: Send,
    after_step: AfterStep | None = None,
) -> None:
    """Drive the engine token by token, the ``n`` sequences side by side (one token of
    each live sequence per step, as vLLM decodes them); ``emit`` renders each token,
    ``after_step(i)`` runs once all of step ``i``'s tokens are emitted."""
    rec = sim.new_record(rec_id, endpoint, reply.fault)
    seq = sim.engine.add(rec, reply.prompt_ids, reply.fault)
    drop_at = _arg(reply.fault, FaultKind.DROP)
    seqs = [_Sequence(j, pieces, reply, keep_stop) for j, pieces in enumerate(reply.choices)]
    try:
        for i in range(max(s.num for s in seqs)):
            if drop_at is not None and i == drop_at:
                raise Dropped
            live = [s for s in seqs if s.done is None and i < s.num]
            if not live:
                break
            await sim.engine.next_tokens(seq, [sim.tokenizer.token_id(s.pieces[i]) for s in live])
            for s in live:
                await emit(s.step(i))
            if after_step is not None:
                await after_step(i)
        first = seqs[0].done
        sim.engine.finish(seq, "length" if first == "length" else "stop")
    except asyncio.CancelledError:
        sim.engine.abort(seq)  # the client went away: stop generating, free KV
        raise
    except Dropped:
        sim.engine.fail(seq, "drop")
        raise
    except Exception:
        sim.engine.fail(seq, "error")
        raise


def start(send: Send, request_id: str, stream: bool) -> Awaitable[None]:
    headers = SSE_HEADERS if stream else [(b"content-type", JSON.encode())]
    return send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*headers, (b"x-request-id", request_id.encode())],
        }
    )


async def body(send: Send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


def decode(raw: bytes, kind: type[T], status: int) -> T:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise DialectError(status, f"Failed to deserialize the JSON body: {e}") from None


def pick_fault(sim: Simulator, request: Request, status: int) -> Fault | None:
    try:
        return sim.pick_fault(request.headers.get("x-sim-fault"))
    except ApiError as e:
        raise DialectError(status, e.message) from None


def simulator(request: Request) -> Simulator:
    sim: Simulator = request.app.state.sim
    return sim

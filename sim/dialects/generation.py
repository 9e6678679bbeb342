"""What the TGI and Triton surfaces share: planning a reply from a bare prompt,
driving the engine token by token, and the raw ASGI response pieces."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.types import Send

from sim.completions import SSE_HEADERS, StopScanner
from sim.faults import Fault, FaultKind
from sim.inbound import ApiError, ScriptedResponse
from sim.responses import Dropped
from sim.scripts import Conversation, parse_response
from sim.simulator import Simulator
from sim.structured import schema_value
from sim.textgen import natural_pieces

JSON = "application/json"
OVERLOADED = "Model is overloaded"
QUEUE_FULL = "Exceeds maximum queue size"
UNAVAILABLE = "The engine is overloaded or restarting (simulated)."
INTERNAL = "Internal server error (simulated)."

T = TypeVar("T")


class Grammar(msgspec.Struct, frozen=True):
    type: str
    value: Any = None


class DialectError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "validation") -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


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
    """What one dialect request will produce: the prompt and the output pieces."""

    prompt_ids: list[int]
    pieces: list[str]
    max_tokens: int
    stops: list[str]
    fault: Fault | None


def plan(
    sim: Simulator,
    request: Request,
    prompt: str,
    max_tokens: int | None,
    seed: int | None,
    stops: list[str],
    grammar: Grammar | None,
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
    if script is not None:
        sim.stats.scripted += 1
        pieces = sim.tokenizer.pieces(_tool_text(script)) or [""]
    elif grammar is not None and grammar.type == "json":
        pieces = sim.tokenizer.pieces(json.dumps(schema_value(grammar.value)))
    else:
        pieces = natural_pieces(sim.cfg.seed, prompt_ids, seed)
    return Reply(prompt_ids=prompt_ids, pieces=pieces, max_tokens=limit, stops=stops, fault=fault)


def _arg(fault: Fault | None, kind: FaultKind) -> int | None:
    return fault.arg if fault is not None and fault.kind is kind else None


Emit = Callable[[int, str, int, str | None], Awaitable[None]]


async def generate(
    sim: Simulator,
    reply: Reply,
    rec_id: str,
    endpoint: str,
    emit: Emit,
    keep_stop: bool,
    send: Send,
) -> None:
    """Drive the engine token by token; `emit(i, delta, tokens, finish)` renders each."""
    rec = sim.new_record(rec_id, endpoint, reply.fault)
    seq = sim.engine.add(rec, reply.prompt_ids, reply.fault)
    drop_at = _arg(reply.fault, FaultKind.DROP)
    scanner = StopScanner([] if keep_stop else reply.stops)
    text = ""
    hit = False
    try:
        n = min(len(reply.pieces), reply.max_tokens)
        finish = "length" if len(reply.pieces) > reply.max_tokens else "stop"
        for i, piece in enumerate(reply.pieces[:n]):
            if drop_at is not None and i == drop_at:
                raise Dropped
            await sim.engine.next_token(seq, sim.tokenizer.token_id(piece))
            if keep_stop:
                text += piece
                hit = any(s in text for s in reply.stops)
                delta = piece
            else:
                delta = scanner.push(piece)
                hit = scanner.matched is not None
            last = hit or i == n - 1
            reason = ("stop_sequence" if hit else finish) if last else None
            if last and not keep_stop:
                delta += scanner.flush()
            await emit(i, delta, seq.generated, reason)
            if last:
                break
        sim.engine.finish(seq, "length" if finish == "length" and not hit else "stop")
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

"""The simulator's TGI and Triton surfaces, served by the same engine as its OpenAI one.

- TGI: ``POST /generate_stream`` (SSE token events), ``POST /generate``, ``GET /info``;
  errors ``{"error", "error_type"}`` (422 validation, 429 overloaded, 5xx generation).
  Like TGI, output keeps a matched stop string; ``parameters.grammar`` of type ``json``
  makes an unscripted reply a JSON value of the schema.
- Triton (vLLM backend, generate extension): ``POST /v2/models/{m}/generate_stream``,
  ``POST /v2/models/{m}/generate``, ``GET /v2/health/ready``, ``GET /v2/health/live``,
  ``GET /v2/models/{m}/ready``; errors ``{"error"}``. A full queue (the ``429`` fault) is
  Triton's 503 "Exceeds maximum queue size"; stop strings are cut, as vLLM does.

Both honour ``X-Sim-Fault`` (status faults, drop, stall, slow, malformed) and scripts
(``X-Sim-Script`` or ``/sim/scripts`` rules); a scripted tool call is rendered as the
Hermes ``<tool_call>{...}</tool_call>`` text a tool-calling model would write.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import Gauge
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Send

from sim.completions import SSE_HEADERS, StopScanner
from sim.faults import Fault, FaultKind
from sim.inbound import ApiError, ScriptedResponse
from sim.malformed import with_malformed
from sim.responses import Dropped, GuardedResponse
from sim.scripts import Conversation, parse_response
from sim.simulator import Simulator
from sim.textgen import natural_pieces

JSON = "application/json"
_OVERLOADED = "Model is overloaded"
_QUEUE_FULL = "Exceeds maximum queue size"
_UNAVAILABLE = "The engine is overloaded or restarting (simulated)."
_INTERNAL = "Internal server error (simulated)."


class _Grammar(msgspec.Struct, frozen=True):
    type: str
    value: Any = None


class _TgiParameters(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = []
    details: bool = False
    decoder_input_details: bool = False
    grammar: _Grammar | None = None


class _TgiRequest(msgspec.Struct, frozen=True, kw_only=True):
    inputs: str
    parameters: _TgiParameters = _TgiParameters()


class _TritonParameters(msgspec.Struct, frozen=True, kw_only=True):
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None


class _TritonRequest(msgspec.Struct, frozen=True, kw_only=True):
    text_input: str
    parameters: _TritonParameters = _TritonParameters()
    exclude_input_in_output: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


class _DialectError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "validation") -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


def _sse(obj: object) -> bytes:
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


def _schema_value(schema: Any) -> Any:
    """A deterministic value that satisfies a (simple) JSON schema."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _schema_value(schema[key][0])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {name: _schema_value(sub) for name, sub in props.items()}
    if kind == "array":
        return [_schema_value(schema.get("items"))]
    return {"string": "sim", "number": 1.5, "integer": 1, "boolean": True}.get(str(kind))


class _Reply(msgspec.Struct, kw_only=True):
    """What one dialect request will produce: the prompt and the output pieces."""

    prompt_ids: list[int]
    pieces: list[str]
    max_tokens: int
    stops: list[str]
    fault: Fault | None


def _plan(
    sim: Simulator,
    request: Request,
    prompt: str,
    max_tokens: int | None,
    seed: int | None,
    stops: list[str],
    grammar: _Grammar | None,
    fault: Fault | None,
) -> _Reply:
    prompt_ids = sim.tokenizer.encode(prompt)
    try:
        limit = sim.check_length(len(prompt_ids), max_tokens)
    except ApiError as e:
        raise _DialectError(422, e.message) from None
    header = request.headers.get("x-sim-script")
    conv = Conversation(last_user=prompt, last_role="user", prompt=prompt)
    try:
        script = parse_response(header) if header is not None else sim.scripts.pick(conv)
    except ApiError as e:
        raise _DialectError(422, e.message) from None
    if script is not None:
        sim.stats.scripted += 1
        pieces = sim.tokenizer.pieces(_tool_text(script)) or [""]
    elif grammar is not None and grammar.type == "json":
        pieces = sim.tokenizer.pieces(json.dumps(_schema_value(grammar.value)))
    else:
        pieces = natural_pieces(sim.cfg.seed, prompt_ids, seed)
    return _Reply(prompt_ids=prompt_ids, pieces=pieces, max_tokens=limit, stops=stops, fault=fault)


def _arg(fault: Fault | None, kind: FaultKind) -> int | None:
    return fault.arg if fault is not None and fault.kind is kind else None


Emit = Callable[[int, str, int, str | None], Awaitable[None]]


async def _generate(
    sim: Simulator,
    reply: _Reply,
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


def _start(send: Send, request_id: str, stream: bool) -> Awaitable[None]:
    headers = SSE_HEADERS if stream else [(b"content-type", JSON.encode())]
    return send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*headers, (b"x-request-id", request_id.encode())],
        }
    )


async def _body(send: Send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


def _decode(raw: bytes, kind: type[Any], status: int) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _DialectError(status, f"Failed to deserialize the JSON body: {e}") from None


def _fault(sim: Simulator, request: Request, status: int) -> Fault | None:
    try:
        return sim.pick_fault(request.headers.get("x-sim-fault"))
    except ApiError as e:
        raise _DialectError(status, e.message) from None


# -- TGI -----------------------------------------------------------------------------


def _tgi_error(status: int, message: str, error_type: str) -> Response:
    headers = {"retry-after": "1"} if status in (429, 503) else None
    body = msgspec.json.encode({"error": message, "error_type": error_type})
    return Response(body, status, headers, media_type=JSON)


_TGI_FAULTS = {
    429: (429, _OVERLOADED, "overloaded"),
    503: (503, _UNAVAILABLE, "unavailable"),
    500: (500, _INTERNAL, "generation"),
}


def tgi_routes(sim: Simulator) -> list[Route]:
    async def generate(request: Request, stream: bool) -> Response:
        rid = sim.request_id(request.headers)
        try:
            req: _TgiRequest = _decode(await request.body(), _TgiRequest, 422)
            p = req.parameters
            if p.max_new_tokens is not None and p.max_new_tokens < 1:
                raise _DialectError(422, "`max_new_tokens` must be > 0")
            if p.grammar is not None and p.grammar.type not in ("json", "regex"):
                raise _DialectError(422, f"unknown grammar type {p.grammar.type!r}")
            fault = _fault(sim, request, 422)
            if fault is not None and fault.status is not None:
                endpoint = "tgi_generate_stream" if stream else "tgi_generate"
                sim.record_failure(sim.new_record(rid, endpoint, fault), f"http_{fault.status}")
                return _tgi_error(*_TGI_FAULTS[fault.status])
            reply = _plan(
                sim, request, req.inputs, p.max_new_tokens, p.seed, p.stop, p.grammar, fault
            )
        except _DialectError as e:
            return _tgi_error(e.status, f"Input validation error: {e.message}", e.error_type)

        def details(reason: str, tokens: int) -> dict[str, Any] | None:
            if not p.details:
                return None
            return {
                "finish_reason": "eos_token" if reason == "stop" else reason,
                "generated_tokens": tokens,
                "seed": p.seed,
                "input_length": len(reply.prompt_ids),
            }

        async def body(send: Send) -> None:
            text = ""

            async def emit(i: int, delta: str, tokens: int, reason: str | None) -> None:
                nonlocal text
                text += delta
                if i == 0:
                    await _start(send, rid, stream)
                if not stream:
                    return
                event = {
                    "index": i + 1,
                    "token": {
                        "id": sim.tokenizer.token_id(delta),
                        "text": delta,
                        "logprob": -0.25,
                        "special": False,
                    },
                    "generated_text": text if reason else None,
                    "details": details(reason, tokens) if reason else None,
                    "top_tokens": None,
                }
                await _body(send, _sse(event))

            endpoint = "tgi_generate_stream" if stream else "tgi_generate"
            reasons: list[tuple[str, int]] = []

            async def track(i: int, delta: str, tokens: int, reason: str | None) -> None:
                await emit(i, delta, tokens, reason)
                if reason:
                    reasons.append((reason, tokens))

            await _generate(sim, reply, rid, endpoint, track, True, send)
            if stream:
                await _body(send, b"", more=False)
                return
            reason, tokens = reasons[-1]
            payload = {"generated_text": text, "details": details(reason, tokens)}
            await _body(send, msgspec.json.encode(payload), more=False)

        return with_malformed(fault, GuardedResponse(body))

    async def generate_stream(request: Request) -> Response:
        return await generate(request, stream=True)

    async def generate_once(request: Request) -> Response:
        return await generate(request, stream=False)

    async def info(request: Request) -> Response:
        body = {
            "model_id": sim.model,
            "max_input_tokens": sim.max_model_len - 1,
            "max_total_tokens": sim.max_model_len,
            "max_concurrent_requests": sim.max_num_seqs,
            "version": "0.0.0+jetserve.sim",
        }
        return Response(msgspec.json.encode(body), media_type=JSON)

    return [
        Route("/generate_stream", generate_stream, methods=["POST"]),
        Route("/generate", generate_once, methods=["POST"]),
        Route("/info", info, methods=["GET"]),
    ]


# -- Triton --------------------------------------------------------------------------


def _triton_error(status: int, message: str) -> Response:
    return Response(msgspec.json.encode({"error": message}), status, media_type=JSON)


_TRITON_FAULTS = {429: (503, _QUEUE_FULL), 503: (503, _UNAVAILABLE), 500: (500, _INTERNAL)}


def triton_routes(sim: Simulator) -> list[Route]:
    async def generate(request: Request, stream: bool) -> Response:
        rid = sim.request_id(request.headers)
        model = request.path_params["model"]
        try:
            if model not in sim.served_models:
                raise _DialectError(400, f"Request for unknown model: '{model}' is not found")
            req: _TritonRequest = _decode(await request.body(), _TritonRequest, 400)
            p = req.parameters
            if p.max_tokens is not None and p.max_tokens < 1:
                raise _DialectError(400, "max_tokens must be at least 1")
            fault = _fault(sim, request, 400)
            if fault is not None and fault.status is not None:
                endpoint = "triton_generate_stream" if stream else "triton_generate"
                sim.record_failure(sim.new_record(rid, endpoint, fault), f"http_{fault.status}")
                return _triton_error(*_TRITON_FAULTS[fault.status])
            stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
            reply = _plan(sim, request, req.text_input, p.max_tokens, p.seed, stops, None, fault)
        except _DialectError as e:
            # vLLM's context-length ValueError reaches the client as a 400.
            return _triton_error(400 if e.status == 422 else e.status, e.message)

        def chunk(text: str, tokens: int, reason: str | None) -> dict[str, Any]:
            out: dict[str, Any] = {"model_name": model, "model_version": "1", "text_output": text}
            if req.return_num_input_tokens:
                out["num_input_tokens"] = len(reply.prompt_ids)
            if req.return_num_output_tokens:
                out["num_output_tokens"] = tokens
            if req.return_finish_reason and reason:
                out["finish_reason"] = "stop" if reason == "stop_sequence" else reason
            return out

        async def body(send: Send) -> None:
            text = ""
            final: list[tuple[str, int]] = []

            async def emit(i: int, delta: str, tokens: int, reason: str | None) -> None:
                nonlocal text
                text += delta
                if i == 0:
                    await _start(send, rid, stream)
                if stream:  # one response per step: its new text and its one token
                    await _body(send, _sse(chunk(delta, 1, reason)))
                if reason:
                    final.append((reason, tokens))

            endpoint = "triton_generate_stream" if stream else "triton_generate"
            await _generate(sim, reply, rid, endpoint, emit, False, send)
            if stream:
                await _body(send, b"", more=False)
                return
            reason, tokens = final[-1]
            full = text if req.exclude_input_in_output else req.text_input + text
            await _body(send, msgspec.json.encode(chunk(full, tokens, reason)), more=False)

        return with_malformed(fault, GuardedResponse(body))

    async def generate_stream(request: Request) -> Response:
        return await generate(request, stream=True)

    async def generate_once(request: Request) -> Response:
        return await generate(request, stream=False)

    async def ready(request: Request) -> Response:
        return Response(status_code=200)

    async def model_ready(request: Request) -> Response:
        known = request.path_params["model"] in sim.served_models
        return Response(status_code=200 if known else 400)

    return [
        Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
        Route("/v2/models/{model}/generate", generate_once, methods=["POST"]),
        Route("/v2/models/{model}/ready", model_ready, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/health/live", ready, methods=["GET"]),
    ]


def dialect_routes(sim: Simulator) -> list[Route]:
    """TGI's and Triton's routes, and TGI's queue gauges next to the vLLM ones."""
    registry = sim.metrics.registry
    Gauge("tgi_queue_size", "Current queue size", registry=registry).set_function(
        lambda: len(sim.engine.waiting)
    )
    Gauge("tgi_batch_current_size", "Current batch size", registry=registry).set_function(
        lambda: len(sim.engine.running)
    )
    return [*tgi_routes(sim), *triton_routes(sim)]

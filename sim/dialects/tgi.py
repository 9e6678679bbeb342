"""The simulator's TGI surface: ``POST /generate_stream`` (SSE token events),
``POST /generate``, ``GET /info``; errors ``{"error", "error_type"}``.

Like TGI, output keeps a matched stop string; ``parameters.grammar`` of type
``json`` makes an unscripted reply a JSON value of the schema.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Send

from sim.dialects.generation import (
    INTERNAL,
    JSON,
    OVERLOADED,
    UNAVAILABLE,
    DialectError,
    Grammar,
    Reply,
    body,
    decode,
    generate,
    pick_fault,
    plan,
    simulator,
    sse,
    start,
)
from sim.malformed import with_malformed
from sim.responses import GuardedResponse
from sim.simulator import Simulator


class _TgiParameters(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = []
    details: bool = False
    decoder_input_details: bool = False
    grammar: Grammar | None = None


class _TgiRequest(msgspec.Struct, frozen=True, kw_only=True):
    inputs: str
    parameters: _TgiParameters = _TgiParameters()


def _tgi_error(status: int, message: str, error_type: str) -> Response:
    headers = {"retry-after": "1"} if status in (429, 503) else None
    payload = msgspec.json.encode({"error": message, "error_type": error_type})
    return Response(payload, status, headers, media_type=JSON)


_TGI_FAULTS = {
    429: (429, OVERLOADED, "overloaded"),
    503: (503, UNAVAILABLE, "unavailable"),
    500: (500, INTERNAL, "generation"),
}


def _endpoint(stream: bool) -> str:
    return "tgi_generate_stream" if stream else "tgi_generate"


async def _accept(
    sim: Simulator, request: Request, rid: str, stream: bool
) -> tuple[_TgiRequest, Reply] | Response:
    """The validated request and its planned reply, or the error response."""
    try:
        req = decode(await request.body(), _TgiRequest, 422)
        p = req.parameters
        if p.max_new_tokens is not None and p.max_new_tokens < 1:
            raise DialectError(422, "`max_new_tokens` must be > 0")
        if p.grammar is not None and p.grammar.type not in ("json", "regex"):
            raise DialectError(422, f"unknown grammar type {p.grammar.type!r}")
        fault = pick_fault(sim, request, 422)
        if fault is not None and fault.status is not None:
            record = sim.new_record(rid, _endpoint(stream), fault)
            sim.record_failure(record, f"http_{fault.status}")
            return _tgi_error(*_TGI_FAULTS[fault.status])
        reply = plan(sim, request, req.inputs, p.max_new_tokens, p.seed, p.stop, p.grammar, fault)
    except DialectError as e:
        return _tgi_error(e.status, f"Input validation error: {e.message}", e.error_type)
    return req, reply


def _details(p: _TgiParameters, reply: Reply, reason: str, tokens: int) -> dict[str, Any] | None:
    if not p.details:
        return None
    return {
        "finish_reason": "eos_token" if reason == "stop" else reason,
        "generated_tokens": tokens,
        "seed": p.seed,
        "input_length": len(reply.prompt_ids),
    }


def _body(
    sim: Simulator, req: _TgiRequest, reply: Reply, rid: str, stream: bool
) -> Callable[[Send], Awaitable[None]]:
    p = req.parameters

    async def send_body(send: Send) -> None:
        text = ""
        reasons: list[tuple[str, int]] = []

        async def emit(i: int, delta: str, tokens: int, reason: str | None) -> None:
            nonlocal text
            text += delta
            if reason:
                reasons.append((reason, tokens))
            if i == 0:
                await start(send, rid, stream)
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
                "details": _details(p, reply, reason, tokens) if reason else None,
                "top_tokens": None,
            }
            await body(send, sse(event))

        await generate(sim, reply, rid, _endpoint(stream), emit, True, send)
        if stream:
            await body(send, b"", more=False)
            return
        reason, tokens = reasons[-1]
        payload = {"generated_text": text, "details": _details(p, reply, reason, tokens)}
        await body(send, msgspec.json.encode(payload), more=False)

    return send_body


async def _generate(request: Request, stream: bool) -> Response:
    sim = simulator(request)
    rid = sim.request_id(request.headers)
    accepted = await _accept(sim, request, rid, stream)
    if isinstance(accepted, Response):
        return accepted
    req, reply = accepted
    return with_malformed(reply.fault, GuardedResponse(_body(sim, req, reply, rid, stream)))


async def generate_stream(request: Request) -> Response:
    return await _generate(request, stream=True)


async def generate_once(request: Request) -> Response:
    return await _generate(request, stream=False)


async def info(request: Request) -> Response:
    sim = simulator(request)
    payload = {
        "model_id": sim.model,
        "max_input_tokens": sim.max_model_len - 1,
        "max_total_tokens": sim.max_model_len,
        "max_concurrent_requests": sim.max_num_seqs,
        "version": "0.0.0+jetserve.sim",
    }
    return Response(msgspec.json.encode(payload), media_type=JSON)


ROUTES = (
    Route("/generate_stream", generate_stream, methods=["POST"]),
    Route("/generate", generate_once, methods=["POST"]),
    Route("/info", info, methods=["GET"]),
)

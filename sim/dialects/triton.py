"""The simulator's Triton surface (vLLM backend, generate extension):
``POST /v2/models/{m}/generate_stream``, ``POST /v2/models/{m}/generate``,
``GET /v2/health/ready``, ``GET /v2/health/live``, ``GET /v2/models/{m}/ready``;
errors ``{"error"}``.

A full queue (the ``429`` fault) is Triton's 503 "Exceeds maximum queue size";
stop strings are cut, as vLLM does.
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
    QUEUE_FULL,
    UNAVAILABLE,
    DialectError,
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


def _triton_error(status: int, message: str) -> Response:
    return Response(msgspec.json.encode({"error": message}), status, media_type=JSON)


_TRITON_FAULTS = {429: (503, QUEUE_FULL), 503: (503, UNAVAILABLE), 500: (500, INTERNAL)}


def _endpoint(stream: bool) -> str:
    return "triton_generate_stream" if stream else "triton_generate"


async def _accept(
    sim: Simulator, request: Request, rid: str, model: str, stream: bool
) -> tuple[_TritonRequest, Reply] | Response:
    """The validated request and its planned reply, or the error response."""
    try:
        if model not in sim.served_models:
            raise DialectError(400, f"Request for unknown model: '{model}' is not found")
        req = decode(await request.body(), _TritonRequest, 400)
        p = req.parameters
        if p.max_tokens is not None and p.max_tokens < 1:
            raise DialectError(400, "max_tokens must be at least 1")
        fault = pick_fault(sim, request, 400)
        if fault is not None and fault.status is not None:
            record = sim.new_record(rid, _endpoint(stream), fault)
            sim.record_failure(record, f"http_{fault.status}")
            return _triton_error(*_TRITON_FAULTS[fault.status])
        stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        seed = None if p.temperature == 0 else p.seed  # greedy: the seed changes nothing
        reply = plan(sim, request, req.text_input, p.max_tokens, seed, stops, None, fault)
    except DialectError as e:
        # vLLM's context-length ValueError reaches the client as a 400.
        return _triton_error(400 if e.status == 422 else e.status, e.message)
    return req, reply


def _chunk(
    req: _TritonRequest, reply: Reply, model: str, text: str, tokens: int, reason: str | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"model_name": model, "model_version": "1", "text_output": text}
    if req.return_num_input_tokens:
        out["num_input_tokens"] = len(reply.prompt_ids)
    if req.return_num_output_tokens:
        out["num_output_tokens"] = tokens
    if req.return_finish_reason and reason:
        out["finish_reason"] = "stop" if reason == "stop_sequence" else reason
    return out


def _body(
    sim: Simulator, req: _TritonRequest, reply: Reply, rid: str, model: str, stream: bool
) -> Callable[[Send], Awaitable[None]]:
    async def send_body(send: Send) -> None:
        text = ""
        final: list[tuple[str, int]] = []

        async def emit(i: int, delta: str, tokens: int, reason: str | None) -> None:
            nonlocal text
            text += delta
            if i == 0:
                await start(send, rid, stream)
            if stream:  # one response per step: its new text and its one token
                await body(send, sse(_chunk(req, reply, model, delta, 1, reason)))
            if reason:
                final.append((reason, tokens))

        await generate(sim, reply, rid, _endpoint(stream), emit, False, send)
        if stream:
            await body(send, b"", more=False)
            return
        reason, tokens = final[-1]
        full = text if req.exclude_input_in_output else req.text_input + text
        payload = _chunk(req, reply, model, full, tokens, reason)
        await body(send, msgspec.json.encode(payload), more=False)

    return send_body


async def _generate(request: Request, stream: bool) -> Response:
    sim = simulator(request)
    rid = sim.request_id(request.headers)
    model = request.path_params["model"]
    accepted = await _accept(sim, request, rid, model, stream)
    if isinstance(accepted, Response):
        return accepted
    req, reply = accepted
    send_body = _body(sim, req, reply, rid, model, stream)
    return with_malformed(reply.fault, GuardedResponse(send_body))


async def generate_stream(request: Request) -> Response:
    return await _generate(request, stream=True)


async def generate_once(request: Request) -> Response:
    return await _generate(request, stream=False)


async def ready(request: Request) -> Response:
    return Response(status_code=200)


async def model_ready(request: Request) -> Response:
    known = request.path_params["model"] in simulator(request).served_models
    return Response(status_code=200 if known else 400)


ROUTES = (
    Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
    Route("/v2/models/{model}/generate", generate_once, methods=["POST"]),
    Route("/v2/models/{model}/ready", model_ready, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route("/v2/health/live", ready, methods=["GET"]),
)

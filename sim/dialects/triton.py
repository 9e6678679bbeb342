"""The simulator's Triton surface (vLLM backend, generate extension):
``POST /v2/models/{m}/generate_stream``, ``POST /v2/models/{m}/generate``,
``GET /v2/health/ready``, ``GET /v2/health/live``, ``GET /v2/models/{m}/ready``;
errors ``{"error"}``.

A full queue (the ``429`` fault) is Triton's 503 "Exceeds maximum queue size";
stop strings are cut, as vLLM does. The sampling parameters are vLLM's
(sim/dialects/triton_params.py). With ``n`` > 1 each output tensor holds one element per
sequence (a list), and a sequence that has not finished reports ``"None"`` as its
finish reason, as the backend writes ``str(output.finish_reason)``. ``return_logprobs``
adds ``logprobs``: per sequence, a JSON string of one ``{token_id: {logprob, rank,
decoded_token}}`` object per new token, the sampled token first;
``return_cumulative_logprob`` adds ``cumulative_logprob``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Send

from sim import logprobs as lp
from sim.dialects.choices import DialectError
from sim.dialects.generation import (
    INTERNAL,
    JSON,
    QUEUE_FULL,
    UNAVAILABLE,
    Reply,
    Step,
    body,
    decode,
    generate,
    pick_fault,
    plan,
    simulator,
    sse,
    start,
)
from sim.dialects.triton_params import TritonSampling, parse, stops, triton_spec
from sim.malformed import with_malformed
from sim.responses import GuardedResponse
from sim.simulator import Simulator


class _TritonRequest(msgspec.Struct, frozen=True, kw_only=True):
    text_input: str
    parameters: dict[str, Any] = {}
    sampling_parameters: str | None = None
    stream: bool | None = None
    exclude_input_in_output: bool | None = None
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _triton_error(status: int, message: str) -> Response:
    return Response(msgspec.json.encode({"error": message}), status, media_type=JSON)


_TRITON_FAULTS = {429: (503, QUEUE_FULL), 503: (503, UNAVAILABLE), 500: (500, INTERNAL)}


def _endpoint(stream: bool) -> str:
    return "triton_generate_stream" if stream else "triton_generate"


async def _accept(
    sim: Simulator, request: Request, rid: str, model: str, stream: bool
) -> tuple[_TritonRequest, TritonSampling, Reply] | Response:
    """The validated request and its planned reply, or the error response."""
    try:
        if model not in sim.served_models:
            raise DialectError(400, f"Request for unknown model: '{model}' is not found")
        req = decode(await request.body(), _TritonRequest, 400)
        p = parse(req.sampling_parameters, req.parameters)
        if p.max_tokens is not None and p.max_tokens < 1:
            raise DialectError(400, "max_tokens must be at least 1")
        if stream and req.exclude_input_in_output is False:
            raise DialectError(
                400, "When streaming, `exclude_input_in_output` = False is not allowed."
            )
        s = triton_spec(sim, p)
        fault = pick_fault(sim, request, 400)
        if fault is not None and fault.status is not None:
            record = sim.new_record(rid, _endpoint(stream), fault)
            sim.record_failure(record, f"http_{fault.status}")
            return _triton_error(*_TRITON_FAULTS[fault.status])
        reply = plan(sim, request, req.text_input, p.max_tokens, stops(p), s, fault)
    except DialectError as e:
        # vLLM's context-length ValueError reaches the client as a 400.
        return _triton_error(400 if e.status == 422 else e.status, e.message)
    return req, p, reply


class _Out:
    """One sequence's output since the last response, and over the whole request."""

    def __init__(self) -> None:
        self.delta = ""
        self.text = ""
        self.new_tokens = 0
        self.tokens = 0
        self.logprobs: list[dict[str, Any]] = []
        self.cumulative = 0.0
        self.reason: str | None = None

    def add(self, sim: Simulator, step: Step, top: int | None) -> None:
        self.delta += step.delta
        self.text += step.delta
        self.new_tokens += 1
        self.tokens = step.tokens
        entry = lp.TokenLogprob(step.piece, step.i, max(top or 0, 1))
        self.cumulative = round(self.cumulative + entry.logprob, 4)
        if top is not None:
            # The sampled token first, then the top ``top`` (it is the likeliest here).
            alts = entry.alternatives[: max(top, 1)]
            self.logprobs.append(
                {
                    str(sim.tokenizer.token_id(t)): {"logprob": v, "rank": r, "decoded_token": t}
                    for r, (t, v) in enumerate(alts, start=1)
                }
            )
        if step.reason:
            self.reason = "stop" if step.reason == "stop_sequence" else step.reason

    def take(self) -> tuple[str, int, list[dict[str, Any]]]:
        out = (self.delta, self.new_tokens, self.logprobs)
        self.delta, self.new_tokens, self.logprobs = "", 0, []
        return out


def _tensor(values: list[Any]) -> Any:
    """A one-element output as a scalar, several as a list."""
    return values[0] if len(values) == 1 else values


def _response(
    req: _TritonRequest,
    reply: Reply,
    model: str,
    texts: list[str],
    counts: list[int],
    outs: list[_Out],
    lps: list[list[dict[str, Any]]],
) -> dict[str, Any]:
    out: dict[str, Any] = {"model_name": model, "model_version": "1", "text_output": _tensor(texts)}
    if req.return_num_input_tokens:
        out["num_input_tokens"] = len(reply.prompt_ids)
    if req.return_num_output_tokens:
        out["num_output_tokens"] = _tensor(counts)
    if req.return_finish_reason:
        reasons = [str(o.reason) for o in outs]  # "None" while a sequence runs
        if len(outs) > 1 or outs[0].reason is not None:
            out["finish_reason"] = _tensor(reasons)
    if req.return_cumulative_logprob:
        out["cumulative_logprob"] = _tensor([o.cumulative for o in outs])
    if req.return_logprobs:
        out["logprobs"] = _tensor([json.dumps(x) for x in lps])
    return out


def _body(
    sim: Simulator,
    req: _TritonRequest,
    p: TritonSampling,
    reply: Reply,
    rid: str,
    model: str,
    stream: bool,
) -> Callable[[Send], Awaitable[None]]:
    top = p.logprobs if req.return_logprobs else None

    async def send_body(send: Send) -> None:
        outs = [_Out() for _ in reply.choices]
        all_lps: list[list[dict[str, Any]]] = [[] for _ in reply.choices]

        async def emit(step: Step) -> None:
            outs[step.index].add(sim, step, top)

        async def after_step(i: int) -> None:
            if i == 0:
                await start(send, rid, stream)
            taken = [o.take() for o in outs]
            for j, (_, _, lps) in enumerate(taken):
                all_lps[j].extend(lps)
            if stream:  # one response per step: each sequence's new text and tokens
                texts = [t for t, _, _ in taken]
                counts = [c for _, c, _ in taken]
                chunk = _response(req, reply, model, texts, counts, outs, [x for *_, x in taken])
                await body(send, sse(chunk))

        await generate(sim, reply, rid, _endpoint(stream), emit, False, send, after_step)
        if stream:
            await body(send, b"", more=False)
            return
        prefix = "" if req.exclude_input_in_output is not False else req.text_input
        texts = [prefix + o.text for o in outs]
        payload = _response(req, reply, model, texts, [o.tokens for o in outs], outs, all_lps)
        await body(send, msgspec.json.encode(payload), more=False)

    return send_body


async def _generate(request: Request, stream: bool) -> Response:
    sim = simulator(request)
    rid = sim.request_id(request.headers)
    model = request.path_params["model"]
    accepted = await _accept(sim, request, rid, model, stream)
    if isinstance(accepted, Response):
        return accepted
    req, p, reply = accepted
    send_body = _body(sim, req, p, reply, rid, model, stream)
    return with_malformed(reply.fault, GuardedResponse(send_body))


async def generate_stream(request: Request) -> Response:
    return await _generate(request, stream=True)


async def generate_once(request: Request) -> Response:
    return await _generate(request, stream=False)


async def ready(request: Request) -> Response:
    return Response(status_code=200)


async def server_metadata(request: Request) -> Response:
    """KServe v2 server metadata: Triton answers its name and version here."""
    body = {"name": "triton", "version": simulator(request).cfg.engine_version}
    return Response(msgspec.json.encode(body), media_type="application/json")


async def model_ready(request: Request) -> Response:
    known = request.path_params["model"] in simulator(request).served_models
    return Response(status_code=200 if known else 400)


ROUTES = (
    Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
    Route("/v2/models/{model}/generate", generate_once, methods=["POST"]),
    Route("/v2/models/{model}/ready", model_ready, methods=["GET"]),
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route("/v2/health/live", ready, methods=["GET"]),
)

"""The simulator's TGI surface: ``POST /generate_stream`` (SSE token events),
``POST /generate``, ``GET /info``; errors ``{"error", "error_type"}``.

Like TGI, output keeps a matched stop string. Every token carries its logprob, and
``top_n_tokens`` alternatives in ``top_tokens``; ``best_of`` (``/generate`` only)
returns the likeliest of that many sequences, the others in
``details.best_of_sequences``; ``decoder_input_details`` lists the prompt's tokens in
``details.prefill``; ``return_full_text`` puts the prompt ahead of the text. The
parameters are checked and applied as sim/dialects/tgi_params.py says.
"""

from __future__ import annotations

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
    OVERLOADED,
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
from sim.dialects.tgi_params import MAX_BEST_OF, MAX_TOP_N_TOKENS, TgiParameters, tgi_spec, top_n
from sim.malformed import tgi_error_event, with_malformed
from sim.responses import GuardedResponse
from sim.simulator import Simulator


class _TgiRequest(msgspec.Struct, frozen=True, kw_only=True):
    inputs: str
    parameters: TgiParameters = TgiParameters()


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
        s = tgi_spec(sim, p, stream)
        fault = pick_fault(sim, request, 422)
        if fault is not None and fault.status is not None:
            record = sim.new_record(rid, _endpoint(stream), fault)
            sim.record_failure(record, f"http_{fault.status}")
            return _tgi_error(*_TGI_FAULTS[fault.status])
        reply = plan(sim, request, req.inputs, p.max_new_tokens, p.stop, s, fault)
    except DialectError as e:
        return _tgi_error(e.status, f"Input validation error: {e.message}", e.error_type)
    return req, reply


def _token(sim: Simulator, text: str, logprob: float) -> dict[str, Any]:
    return {"id": sim.tokenizer.token_id(text), "text": text, "logprob": logprob, "special": False}


class _Seq:
    """One sequence as TGI reports it: its tokens (with logprobs) and text."""

    def __init__(self, sim: Simulator, top: int) -> None:
        self.sim, self.top = sim, top
        self.tokens: list[dict[str, Any]] = []
        self.top_tokens: list[list[dict[str, Any]]] = []
        self.text = ""
        self.reason = "length"
        self.generated = 0

    def add(self, step: Step) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        entry = lp.TokenLogprob(step.piece, step.i, self.top)
        token = _token(self.sim, step.piece, lp.TokenLogprob(step.piece, step.i, 0).logprob)
        tops = [_token(self.sim, t, v) for t, v in entry.alternatives]
        self.tokens.append(token)
        self.top_tokens.append(tops)
        self.text += step.delta
        self.generated = step.tokens
        if step.reason:
            self.reason = step.reason
        return token, tops

    @property
    def logprob(self) -> float:
        return sum(float(t["logprob"]) for t in self.tokens)

    def details(self, p: TgiParameters, prefill: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "finish_reason": "eos_token" if self.reason == "stop" else self.reason,
            "generated_tokens": self.generated,
            "seed": p.seed,
            "prefill": prefill,
            "tokens": self.tokens,
        }
        if self.top:
            out["top_tokens"] = self.top_tokens
        return out


def _prefill(sim: Simulator, inputs: str, p: TgiParameters) -> list[dict[str, Any]]:
    if not p.decoder_input_details:
        return []
    pieces = sim.tokenizer.pieces(inputs)
    return [
        {
            "id": sim.tokenizer.token_id(t),
            "text": t,
            "logprob": None if i == 0 else lp.TokenLogprob(t, i, 0).logprob,
        }
        for i, t in enumerate(pieces)
    ]


def _body(
    sim: Simulator, req: _TgiRequest, reply: Reply, rid: str, stream: bool
) -> Callable[[Send], Awaitable[None]]:
    p = req.parameters
    prefix = req.inputs if p.return_full_text else ""

    async def send_body(send: Send) -> None:
        seqs = [_Seq(sim, top_n(p)) for _ in reply.choices]
        started = False

        async def emit(step: Step) -> None:
            nonlocal started
            token, tops = seqs[step.index].add(step)
            if not started:
                started = True
                await start(send, rid, stream)
            if not stream:
                return
            s = seqs[step.index]
            details = None
            if step.reason:
                details = {
                    "finish_reason": "eos_token" if s.reason == "stop" else s.reason,
                    "generated_tokens": s.generated,
                    "seed": p.seed,
                    "input_length": len(reply.prompt_ids),
                }
            event = {
                "index": step.i + 1,
                "token": {**token, "text": step.piece},
                "top_tokens": tops if p.top_n_tokens else [],
                "generated_text": prefix + s.text if step.reason else None,
                "details": details if p.details else None,
            }
            await body(send, sse(event))

        await generate(sim, reply, rid, _endpoint(stream), emit, True, send)
        if stream:
            await body(send, b"", more=False)
            return
        # best_of: the likeliest sequence is the answer, the others come in details.
        order = sorted(range(len(seqs)), key=lambda j: (-seqs[j].logprob, j))
        best = seqs[order[0]]
        payload: dict[str, Any] = {"generated_text": prefix + best.text}
        if p.details:
            prefill = _prefill(sim, req.inputs, p)
            details = best.details(p, prefill)
            if len(seqs) > 1:
                details["best_of_sequences"] = [
                    {**seqs[j].details(p, prefill), "generated_text": prefix + seqs[j].text}
                    for j in order[1:]
                ]
            payload["details"] = details
        await body(send, msgspec.json.encode(payload), more=False)

    return send_body


async def _generate(request: Request, stream: bool) -> Response:
    sim = simulator(request)
    rid = sim.request_id(request.headers)
    accepted = await _accept(sim, request, rid, stream)
    if isinstance(accepted, Response):
        return accepted
    req, reply = accepted
    body = GuardedResponse(_body(sim, req, reply, rid, stream))
    return with_malformed(reply.fault, body, tgi_error_event)


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
        "max_best_of": MAX_BEST_OF,
        "max_top_n_tokens": MAX_TOP_N_TOKENS,
        "version": sim.cfg.engine_version,
    }
    return Response(msgspec.json.encode(payload), media_type=JSON)


ROUTES = (
    Route("/generate_stream", generate_stream, methods=["POST"]),
    Route("/generate", generate_once, methods=["POST"]),
    Route("/info", info, methods=["GET"]),
)

"""Starlette routes: vLLM's OpenAI-compatible surface plus /sim introspection.

Handlers are module functions; the :class:`Simulator` lives on ``app.state.sim``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Send

from sim import outbound as out
from sim.clock import Clock
from sim.completions import new_job, start
from sim.config import SimConfig
from sim.dialects import dialect_routes
from sim.embeddings import as_float32, embed, normalize, to_base64
from sim.faults import Fault, FaultKind
from sim.inbound import (
    ApiError,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    NotFound,
    TokenizeRequest,
    decode,
    embedding_inputs,
)
from sim.malformed import openai_error_event, with_malformed
from sim.planning import plan_chat, plan_completion
from sim.records import RequestRecord
from sim.responses import GuardedResponse
from sim.scripts import parse_rules
from sim.simulator import Simulator
from sim.tokenizer import render_chat

JSON = "application/json"
Endpoint = Callable[[Request], Awaitable[Response]]

_FAULT_MESSAGES = {
    429: "Rate limit exceeded (simulated). Please retry after 1 second.",
    503: "The engine is overloaded or restarting (simulated).",
    500: "Internal server error (simulated).",
}


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type=JSON)


def _error(status: int, message: str, param: str | None = None) -> Response:
    headers = {"retry-after": "1"} if status in (429, 503) else None
    return Response(out.error_body(status, message, param), status, headers, media_type=JSON)


def _api(fn: Endpoint) -> Endpoint:
    """Client errors become OpenAI-shaped error bodies."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except ApiError as e:
            return _error(e.status, e.message, e.param)

    return wrapped


def _sim(request: Request) -> Simulator:
    sim: Simulator = request.app.state.sim
    return sim


def _fault_for(
    sim: Simulator, request: Request, endpoint: str, request_id: str
) -> tuple[Fault | None, Response | None]:
    """The request's fault; a status fault is answered right here."""
    fault = sim.pick_fault(request.headers.get("x-sim-fault"))
    if fault is None or fault.status is None:
        return fault, None
    sim.record_failure(sim.new_record(request_id, endpoint, fault), f"http_{fault.status}")
    return fault, _error(fault.status, _FAULT_MESSAGES[fault.status])


@_api
async def chat(request: Request) -> Response:
    sim = _sim(request)
    req = decode(await request.body(), ChatRequest)
    model = sim.check_model(req.model)
    rid = sim.request_id(request.headers)
    fault, early = _fault_for(sim, request, "chat", rid)
    if early is not None:
        return early
    plan = plan_chat(sim, req, request.headers)
    job = new_job(sim, plan, chat=True, request_id=rid, model=model, fault=fault)
    job.record.traceparent = request.headers.get("traceparent")
    return with_malformed(fault, start(sim, job), openai_error_event)


@_api
async def completions(request: Request) -> Response:
    sim = _sim(request)
    req = decode(await request.body(), CompletionRequest)
    model = sim.check_model(req.model)
    rid = sim.request_id(request.headers)
    fault, early = _fault_for(sim, request, "completions", rid)
    if early is not None:
        return early
    plan = plan_completion(sim, req, request.headers)
    job = new_job(sim, plan, chat=False, request_id=rid, model=model, fault=fault)
    job.record.traceparent = request.headers.get("traceparent")
    return with_malformed(fault, start(sim, job), openai_error_event)


def _embedding_tokens(sim: Simulator, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, checked the way vLLM checks them."""
    if req.encoding_format not in sim.cfg.embedding_encodings:
        taken = " or ".join(sim.cfg.embedding_encodings)
        raise BadRequest(f"encoding_format must be {taken}", "encoding_format")
    dim = sim.cfg.embedding_dim
    if req.dimensions is not None and not 1 <= req.dimensions <= dim:
        raise BadRequest(f"dimensions must be in [1, {dim}]", "dimensions")
    keep = req.truncate_prompt_tokens
    if keep is not None and (keep < -1 or keep == 0):
        raise BadRequest(
            "truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens"
        )
    if keep == -1:
        keep = sim.max_model_len
    token_lists: list[list[int]] = []
    for item in embedding_inputs(req.input):
        ids = sim.tokenizer.encode(item) if isinstance(item, str) else item
        if isinstance(item, list):
            sim.check_token_ids(item)
        if keep is not None:
            ids = ids[-keep:]
        if len(ids) > sim.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {sim.max_model_len} tokens. "
                f"However, you requested {len(ids)} tokens in the input.",
                "input",
            )
        token_lists.append(ids)
    return token_lists


def _embedding_payload(
    sim: Simulator, req: EmbeddingRequest, model: str, rid: str, token_lists: list[list[int]]
) -> bytes:
    dim = sim.cfg.embedding_dim
    data = []
    for i, ids in enumerate(token_lists):
        vec = embed(ids, dim, sim.cfg.seed)
        if req.dimensions is not None and req.dimensions < dim:
            vec = normalize(vec[: req.dimensions])  # Matryoshka-style truncation
        vec = as_float32(vec)
        value: list[float] | str = to_base64(vec) if req.encoding_format == "base64" else vec
        data.append(out.EmbeddingData(index=i, embedding=value))
    total = sum(len(t) for t in token_lists)
    return msgspec.json.encode(
        out.EmbeddingResponse(
            id=f"embd-{rid}",
            created=int(time.time()),
            model=model,
            data=data,
            usage=out.EmbeddingUsage(prompt_tokens=total, total_tokens=total),
        )
    )


@_api
async def embeddings(request: Request) -> Response:
    sim = _sim(request)
    req = decode(await request.body(), EmbeddingRequest)
    model = sim.check_model(req.model)
    token_lists = _embedding_tokens(sim, req)
    rid = sim.request_id(request.headers)
    fault, early = _fault_for(sim, request, "embeddings", rid)
    if early is not None:
        return early
    total = sum(len(t) for t in token_lists)
    delay = sim.profile.embed(total)
    if fault is not None and fault.kind is FaultKind.STALL:
        delay += (fault.arg or 0) / 1000.0
    rec = sim.new_record(rid, "embeddings", fault)
    rec.prompt_tokens = total

    async def body(send: Send) -> None:
        await _embed_slot(sim, rec, delay)
        payload = _embedding_payload(sim, req, model, rid, token_lists)
        rec.status, rec.finished_at, rec.finish_reason = "finished", time.time(), "stop"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", JSON.encode()),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    return GuardedResponse(body)


async def _embed_slot(sim: Simulator, rec: RequestRecord, delay: float) -> None:
    """The embedding's compute time, in one of the engine's embedding slots."""
    rec.status = "running"
    sim.records.add(rec)
    sim.stats.embeddings += 1
    try:
        async with sim.embed_slots:
            await asyncio.sleep(delay)
    except asyncio.CancelledError:
        rec.status, rec.aborted_at = "aborted", time.time()
        raise


@_api
async def models(request: Request) -> Response:
    sim = _sim(request)
    loras = set(sim.loras)
    cards = [
        out.ModelCard(
            id=name,
            created=sim.created,
            root=name if name in loras else sim.model,
            parent=sim.model if name in loras else None,
            max_model_len=sim.max_model_len,
        )
        for name in sim.served_models
    ]
    return _json(out.ModelList(data=cards))


class LoraLoad(msgspec.Struct, frozen=True):
    lora_name: str
    lora_path: str = ""  # vLLM loads the weights from here; the simulator has none


@_api
async def load_lora_adapter(request: Request) -> Response:
    """vLLM's run-time LoRA loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the
    adapter is served, and listed in /v1/models, from now on."""
    sim = _sim(request)
    name = decode(await request.body(), LoraLoad).lora_name
    if not name or name in sim.served_models:
        raise BadRequest(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    sim.loras.append(name)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


@_api
async def unload_lora_adapter(request: Request) -> Response:
    sim = _sim(request)
    name = decode(await request.body(), LoraLoad).lora_name
    if name not in sim.loras:
        raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
    sim.loras.remove(name)
    text = f"Success: LoRA adapter '{name}' removed successfully."
    return Response(text, media_type="text/plain")


@_api
async def tokenize(request: Request) -> Response:
    sim = _sim(request)
    req = decode(await request.body(), TokenizeRequest)
    sim.check_model(req.model)
    sim.stats.tokenize += 1
    if req.messages is not None:
        text = render_chat(req.messages, req.tools, req.add_generation_prompt)
        ids = sim.tokenizer.encode(text)
        strs = sim.tokenizer.pieces(text)
    elif isinstance(req.prompt, str):
        ids, strs = sim.tokenizer.encode(req.prompt), sim.tokenizer.pieces(req.prompt)
    elif req.prompt is not None:
        sim.check_token_ids(req.prompt)
        ids, strs = req.prompt, []
    else:
        raise BadRequest("either prompt or messages is required", "prompt")
    return _json(
        out.TokenizeResponse(
            count=len(ids),
            max_model_len=sim.max_model_len,
            tokens=ids,
            token_strs=strs if req.return_token_strs else None,
        )
    )


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return _json({"version": _sim(request).cfg.engine_version})


async def metrics(request: Request) -> Response:
    return Response(_sim(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def stats(request: Request) -> Response:
    return Response(_sim(request).stats_view(), media_type=JSON)


@_api
async def request_record(request: Request) -> Response:
    rid = request.path_params["request_id"]
    rec = _sim(request).records.get(rid)
    if rec is None:
        raise NotFound(f"no record of request {rid!r}", "request_id")
    return _json(rec)


@_api
async def scripts(request: Request) -> Response:
    sim = _sim(request)
    if request.method == "POST":
        append = request.query_params.get("append", "").lower() in ("1", "true", "yes")
        sim.scripts.load(parse_rules(await request.body()), append=append)
    elif request.method == "DELETE":
        sim.scripts.clear()
    return _json({"rules": sim.scripts.describe()})


ROUTES: tuple[BaseRoute, ...] = (
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/sim/stats", stats, methods=["GET"]),
    Route("/sim/requests/{request_id}", request_record, methods=["GET"]),
    Route("/sim/scripts", scripts, methods=["GET", "POST", "DELETE"]),
)


def create_app(cfg: SimConfig, clock: Clock | None = None) -> Starlette:
    """The simulator's app; `clock`: the engine's (default: the event loop's)."""
    sim = Simulator(cfg, clock)
    # TGI and Triton surfaces on the same engine.
    app = Starlette(routes=[*ROUTES, *dialect_routes(sim)])
    app.state.sim = sim
    return app

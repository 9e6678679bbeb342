"""An accepted HTTP/WebSocket/NATS body as the :class:`InferenceRequest` the
workers run: the model and class it may use, its deadline, its output bound,
and what it carries of its route contract."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from gateway.config import GatewayConfig
from gateway.errors import BadRequest, NotFound
from gateway.inference import rollout
from gateway.inference.openai_types import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Parsed,
    ParsedType,
    estimate_prompt_tokens,
    floor_prompt_tokens,
    sequences_of,
)
from gateway.inference.route_table import RouteTable
from gateway.tenancy.keys import KeyRecord
from streams.routes import RouteRecord
from streams.subjects import RequestClass
from streams.wire import InferenceRequest, Op

KINDS: dict[Op, ParsedType] = {
    "chat": ChatRequest,
    "completion": CompletionRequest,
    "embedding": EmbeddingRequest,
}
CLASS_HEADER = "x-jetserve-class"
TIMEOUT_HEADER = "x-jetserve-timeout"
DATA_CLASS_HEADER = "x-jetserve-data-class"  # what the request carries (e.g. pii); authorised


def build_request(
    cfg: GatewayConfig,
    routes: RouteTable | None,
    reply_for: Callable[[str, str], str],
    op: Op,
    parsed: Parsed,
    body: dict[str, Any],
    key: KeyRecord,
    headers: Mapping[str, str],
    live_adapters: Callable[[], Mapping[str, str]] = dict,
) -> InferenceRequest:
    """The request, checked against what the key may use (``reply_for``: the
    reply subject of a tenant's request id; ``live_adapters``: the LoRA
    adapters live workers hold)."""
    served = cfg.embedding_models if op == "embedding" else cfg.models
    route = routes.get(parsed.model) if routes is not None else None
    adapter = ""
    if route is None and parsed.model not in served and op != "embedding":
        # A LoRA adapter: listed by a route (its policy and candidates), or held
        # by a live worker (no route: any deployment that holds it).
        route = routes.for_adapter(parsed.model) if routes is not None else None
        if route is not None or parsed.model in live_adapters():
            adapter = parsed.model
    if parsed.model not in served and route is None and not adapter:
        raise NotFound(f"The model '{parsed.model}' does not exist.", param="model")
    cls = _request_class(op, headers)
    tools = tuple(
        t.function.name for t in (parsed.tools or [] if isinstance(parsed, ChatRequest) else [])
    )
    data_class = headers.get(DATA_CLASS_HEADER, "default")
    key.scopes.check(model=parsed.model, cls=cls.value, tools=tools, data_class=data_class)
    timeout = _timeout(cfg, route, headers)
    max_tokens, body = _bounded(cfg, parsed, body)
    _check_context(cfg, route, parsed, max_tokens)
    forwarded = {
        k: v
        for k, v in headers.items()
        if any(k.lower().startswith(p) for p in cfg.forward_header_prefixes)
    }
    now = time.time()
    request_id = uuid.uuid4().hex
    return InferenceRequest(
        id=request_id,
        op=op,
        cls=cls.value,
        model=parsed.model,
        body=body,
        reply=reply_for(key.tenant, request_id),
        deadline=now + timeout,
        tenant=key.tenant,
        key_id=key.key_id,
        traceparent="",  # set by admit(): the request span's own context
        tracestate=headers.get("tracestate", "")[:512],
        prompt_tokens_est=estimate_prompt_tokens(parsed),
        # Every sequence (n choices, or best_of) may run to max_tokens: the hold and the KV
        # budget are for all of them (the context check above is per choice).
        max_tokens=max_tokens * sequences_of(parsed),
        created=now,
        headers=forwarded,
        adapter=adapter,
        packed_vectors=op == "embedding",
        **_route_fields(route),
    )


def _request_class(op: Op, headers: Mapping[str, str]) -> RequestClass:
    if op == "embedding":
        return RequestClass.EMBED
    wanted = headers.get(CLASS_HEADER, RequestClass.INTERACTIVE.value)
    if wanted not in (RequestClass.INTERACTIVE.value, RequestClass.BATCH.value):
        raise BadRequest(f"Unknown request class '{wanted}'.", param=CLASS_HEADER)
    return RequestClass(wanted)


def _timeout(cfg: GatewayConfig, route: RouteRecord | None, headers: Mapping[str, str]) -> float:
    """A route's deadline is the default; the client may only shorten it."""
    timeout = route.contract.deadline_s if route else cfg.default_timeout_s
    if TIMEOUT_HEADER not in headers:
        return timeout
    try:
        timeout = float(headers[TIMEOUT_HEADER])
    except ValueError:
        raise BadRequest("X-Jetserve-Timeout must be seconds.", param=TIMEOUT_HEADER) from None
    if not 0 < timeout <= cfg.max_timeout_s:
        raise BadRequest(
            f"X-Jetserve-Timeout must be in (0, {cfg.max_timeout_s}].", param=TIMEOUT_HEADER
        )
    if route is not None:
        timeout = min(timeout, route.contract.deadline_s)
    return timeout


def _bounded(
    cfg: GatewayConfig, parsed: Parsed, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """The output bound, and the body that tells the engine so."""
    if not isinstance(parsed, ChatRequest | CompletionRequest):
        return 0, body
    max_tokens = parsed.max_tokens or 0
    if isinstance(parsed, ChatRequest) and parsed.max_completion_tokens:
        max_tokens = parsed.max_completion_tokens
    if not max_tokens:
        # The hold is for a bounded output, so the engine gets that bound too
        # (OpenAI's completions default is 16 tokens).
        max_tokens = cfg.default_max_tokens if isinstance(parsed, ChatRequest) else 16
        body = {**body, "max_tokens": max_tokens}
    return max_tokens, body


def context_length(cfg: GatewayConfig, route: RouteRecord | None, model: str) -> int | None:
    """The context a request of ``model`` must fit: the smallest of its route's
    candidates that name one (a fallback may land on any), else the gateway's
    setting for the model; None when unknown."""
    if route is not None:
        named = [d.context_length for d in route.contract.candidates if d.context_length]
        if named:
            return min(named)
    return cfg.context_lengths.get(model)


def _check_context(
    cfg: GatewayConfig, route: RouteRecord | None, parsed: Parsed, max_tokens: int
) -> None:
    """As vLLM checks, before any hold or publish: prompt + max_tokens within the
    model's context. The prompt counts at its lower bound (no tokenizer here), so
    what is refused cannot fit; a closer call is the engine's (its 400 comes back)."""
    if not max_tokens:
        return  # embeddings: the engine truncates or refuses
    limit = context_length(cfg, route, parsed.model)
    if limit is None:
        return
    prompt = floor_prompt_tokens(parsed)
    if prompt + max_tokens <= limit:
        return
    param = "max_completion_tokens" if _asked_completion_tokens(parsed) else "max_tokens"
    raise BadRequest(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{max_tokens} tokens for the completion and the prompt has at least {prompt} "
        f"({prompt + max_tokens} in all). Reduce the prompt or the completion length.",
        code="context_length_exceeded",
        param=param,
    )


def _asked_completion_tokens(parsed: Parsed) -> bool:
    return isinstance(parsed, ChatRequest) and bool(parsed.max_completion_tokens)


def _route_fields(route: RouteRecord | None) -> dict[str, Any]:
    """What a request carries of its route contract (none: workers use their defaults)."""
    if route is None:
        return {}
    c = route.contract
    return {
        "route": c.name,
        "route_revision": route.revision,
        # Without fallback only the preferred deployment may serve it; never a
        # canary deployment until the split (InferenceService.admit) puts the
        # request on the canary arm.
        "candidates": rollout.candidates(c, ""),
        "retry_max": c.retry.max_attempts,
        "retry_on": list(c.retry.on),
    }


def with_id(req: InferenceRequest, request_id: str, reply: str) -> InferenceRequest:
    return msgspec.structs.replace(req, id=request_id, reply=reply)

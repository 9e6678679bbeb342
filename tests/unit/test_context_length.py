"""The gateway's context check (gateway/inference/request_builder.py): prompt +
max_tokens past the model's context is a 400 before any hold; the limit comes
from the route's candidates (the smallest) or the gateway's setting."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.config import GatewayConfig
from gateway.errors import BadRequest
from gateway.inference.openai_types import ChatRequest, CompletionRequest, floor_prompt_tokens
from gateway.inference.request_builder import _check_context, context_length
from streams.routes import Deployment, RouteContract, RouteRecord

CFG = GatewayConfig(nats_url="nats://x", redis_url="redis://x", context_lengths={"sim-8b": 1000})


def chat(max_tokens: int | None = None, text: str = "hi", **extra: Any) -> ChatRequest:
    body: dict[str, Any] = {"model": "sim-8b", "messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    return msgspec.convert(body, ChatRequest)


def route(*lengths: int | None) -> RouteRecord:
    deps = tuple(
        Deployment(name=f"d{i}", adapter="openai", engine="e", model="m", context_length=n)
        for i, n in enumerate(lengths)
    )
    c = RouteContract(name="sim-8b", candidates=deps)
    return RouteRecord(contract=c, revision=1, updated_at=0.0, updated_by="t", fingerprints={})


def test_within_the_context_passes() -> None:
    _check_context(CFG, None, chat(999), 999)  # a 2-byte prompt floors to 0 tokens


def test_max_tokens_past_the_context_is_a_400_naming_it() -> None:
    with pytest.raises(BadRequest) as info:
        _check_context(CFG, None, chat(1001), 1001)
    err = info.value.body()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")
    assert "maximum context length is 1000 tokens" in err["message"]
    assert info.value.status == 400


def test_the_prompt_counts_at_its_lower_bound() -> None:
    text = "x" * 16 * 200  # at least 200 tokens whatever the tokenizer
    assert floor_prompt_tokens(chat(text=text)) == 200
    _check_context(CFG, None, chat(800, text), 800)
    with pytest.raises(BadRequest):
        _check_context(CFG, None, chat(801, text), 801)
    ids = msgspec.convert({"model": "sim-8b", "prompt": list(range(600))}, CompletionRequest)
    assert floor_prompt_tokens(ids) == 600  # token ids count exactly
    with pytest.raises(BadRequest):
        _check_context(CFG, None, ids, 401)


def test_max_completion_tokens_is_the_param_named() -> None:
    req = chat(max_completion_tokens=2000)
    with pytest.raises(BadRequest) as info:
        _check_context(CFG, None, req, 2000)
    assert info.value.param == "max_completion_tokens"


def test_the_route_limit_is_its_smallest_candidate_and_wins() -> None:
    assert context_length(CFG, route(4096, 2048, None), "sim-8b") == 2048
    assert context_length(CFG, route(None), "sim-8b") == 1000  # none named: the gateway's
    assert context_length(CFG, None, "other") is None  # unknown: no check
    _check_context(CFG, None, chat(10**6, model="other"), 10**6)


def test_embeddings_and_unknown_models_are_not_checked() -> None:
    _check_context(CFG, None, chat(5000), 0)  # no output bound (an embedding)

"""The OpenAPI document: the shipped file is current, and the response Structs it is
generated from describe what the renderers really return."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.errors import BadRequest
from gateway.inference.openai_types import (
    ChoiceResult,
    ChunkWriter,
    completion_response,
    embeddings_response,
)
from gateway.ingress import openapi_types as types
from gateway.ingress.openapi import SHIPPED, build_spec, render
from streams.wire import Usage

USAGE = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
CREATED = 1_796_000_000.5  # when the request was accepted: rendered as whole seconds
CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


def test_the_shipped_spec_is_current() -> None:
    """gateway/ingress/openapi.json is generated: ``python -m gateway.ingress.openapi``."""
    assert SHIPPED.read_text() == render()


def test_every_schema_reference_resolves() -> None:
    spec = build_spec(["sim-8b"], ["sim-embed"])
    names = set(spec["components"]["schemas"])
    refs = set(_refs(spec))
    missing = {r for r in refs if r.startswith("#/components/schemas/")} - {
        f"#/components/schemas/{n}" for n in names
    }
    assert not missing


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        here = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return here + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


@pytest.mark.parametrize("tool_calls", [[], CALL], ids=["text", "tool-calls"])
def test_a_chat_completion_is_described(tool_calls: list[dict[str, Any]]) -> None:
    choices = [ChoiceResult(0, "hi", tool_calls), ChoiceResult(1, "ho", [], "length")]
    body = completion_response("chat", "r1", "m", choices, "stop", USAGE, CREATED)
    msgspec.convert(body, types.ChatCompletion)
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["created"] == 1_796_000_000  # the request's, whenever it is rendered


def test_a_completion_is_described() -> None:
    lps = {"tokens": ["hi"], "token_logprobs": [-0.5], "top_logprobs": [{"hi": -0.5}]}
    body = completion_response(
        "completion", "r1", "m", [ChoiceResult(0, "hi", logprobs=lps)], "length", USAGE, CREATED
    )
    msgspec.convert(body, types.Completion)


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings_are_described(encoding: str) -> None:
    body = embeddings_response("m", [[0.5, 1.0]], USAGE, encoding)
    msgspec.convert(body, types.Embeddings)


@pytest.mark.parametrize(
    ("op", "kind"),
    [("chat", types.ChatCompletionChunk), ("completion", types.CompletionChunk)],
)
def test_stream_chunks_are_described(op: str, kind: type[msgspec.Struct]) -> None:
    writer = ChunkWriter(op, "r1", "m", CREATED)
    chunks = [*writer.delta("hi", CALL if op == "chat" else None, None), writer.finish("stop")]
    chunks.append(writer.usage(USAGE))
    for chunk in chunks:
        msgspec.convert(chunk, kind)
        assert chunk["created"] == 1_796_000_000


def test_an_error_is_described() -> None:
    msgspec.convert(BadRequest("no", param="model").body(), types.Error)

"""The OpenAPI 3.1 description of the public (OpenAI-compatible) API.

``GET /openapi.json`` serves it. Every body schema is generated with
``msgspec.json.schema_components`` from the Structs the gateway validates,
writes and answers with (:mod:`gateway.inference.openai_types`,
:mod:`streams.request_ledger`, :mod:`gateway.ingress.openapi_types`), so the spec
cannot drift from the code; the operations are a declarative table here, one
response for each status the code can answer with.

The served spec describes *this* deployment: ``model`` is an enum of the models
the gateway serves (chat and completions) or embeds. ``gateway/ingress/openapi.json``
is the same document for any deployment (``model`` is any string); regenerate it
with ``python -m gateway.ingress.openapi`` (tests/unit/test_openapi_current.py
fails while it is stale).

Conventions, as OpenAPI 3.1 has none for streams:

- ``text/event-stream``: the ``schema`` describes one event (``data``, ``event``,
  ``id``), as OpenAPI 3.2's ``itemSchema`` does; ``data`` is a JSON chunk, a JSON
  error, or ``[DONE]``.
- ``application/x-ndjson``: the ``schema`` describes the lines read as an array.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.inference.openai_types import ChatRequest, CompletionRequest, EmbeddingRequest
from gateway.ingress.openapi_paths import (
    ERROR_RESPONSES,
    OPERATIONS,
    PARAMETERS,
    REF,
    Schema,
    error_response,
    ref,
)
from gateway.ingress.openapi_types import RESPONSE_TYPES
from streams.request_ledger import LedgerRecord

OPENAPI_VERSION = "3.1.0"
API_VERSION = "1"  # the public API's version, not the package's
SHIPPED = Path(__file__).with_name("openapi.json")


# -- components: generated from the Structs -------------------------------------------


def _struct_schemas() -> dict[str, Schema]:
    structs = (ChatRequest, CompletionRequest, EmbeddingRequest, LedgerRecord, *RESPONSE_TYPES)
    _, components = msgspec.json.schema_components(structs, ref_template=REF)
    chat = components["ChatRequest"]
    # `messages` has a default only so the Struct can follow `_Common`'s defaults;
    # parse_body refuses a request without one, so it is required.
    chat["properties"]["messages"].pop("default", None)
    chat["required"] = sorted({*chat["required"], "messages"})
    # streams.wire.Usage: named apart from the OpenAI usage object it is not.
    components["WireUsage"] = {
        **components.pop("Usage"),
        "title": "WireUsage",
        "description": "Token counts; a zero count is left out.",
    }
    components["LedgerRecord"]["properties"]["usage"] = ref("WireUsage")
    return components


def _with_models(
    components: dict[str, Schema], models: Sequence[str], embedding: Sequence[str]
) -> None:
    for name, served in (
        ("ChatRequest", models),
        ("CompletionRequest", models),
        ("EmbeddingRequest", embedding),
    ):
        components[name]["properties"]["model"] = {
            "type": "string",
            "enum": list(served),
            "description": "A model this gateway serves; any other is 404 `model_not_found`.",
        }


def _stream_event(description: str, *chunks: str) -> Schema:
    """One SSE event whose ``data`` is one of ``chunks``, an Error, or ``[DONE]``."""
    payloads = [ref(c) for c in (*chunks, "Error")]
    data = {"type": "string", "contentMediaType": "application/json"}
    return {
        "type": "object",
        "description": description,
        "properties": {
            "event": {"const": "message"},
            "id": {
                "type": "string",
                "pattern": "^[0-9]+$",
                "description": "Unique and increasing within a stream: send it back as "
                "`Last-Event-ID` to resume after it. `[DONE]` and errors have none.",
            },
            "data": {
                "anyOf": [{"const": "[DONE]"}, {**data, "contentSchema": {"anyOf": payloads}}]
            },
        },
        "required": ["data"],
    }


_EVENT_SCHEMAS: dict[str, Schema] = {
    "ChatStreamEvent": _stream_event(
        "One server-sent event of a streamed chat completion: a chunk, an error (the "
        "stream failed after it was committed; e.g. `stream_interrupted`), or `[DONE]`. "
        "`: keep-alive` comments are sent while the stream is quiet.",
        "ChatCompletionChunk",
    ),
    "CompletionStreamEvent": _stream_event(
        "One server-sent event of a streamed completion: a chunk, an error, or `[DONE]`.",
        "CompletionChunk",
    ),
    "ResumedStreamEvent": _stream_event(
        "One server-sent event of a resumed stream (chat or completion).",
        "ChatCompletionChunk",
        "CompletionChunk",
    ),
}


# -- the document ---------------------------------------------------------------------


def build_spec(
    models: Sequence[str] | None = None, embedding_models: Sequence[str] | None = None
) -> dict[str, Any]:
    """The OpenAPI document. With ``models`` (and ``embedding_models``), ``model``
    is an enum of them: the document of one deployment."""
    schemas = _struct_schemas()
    if models is not None or embedding_models is not None:
        _with_models(schemas, models or (), embedding_models or ())
    schemas.update(_EVENT_SCHEMAS)
    paths: dict[str, Schema] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = op.render()
    document = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "jetserve",
            "version": API_VERSION,
            "description": "An OpenAI-compatible LLM gateway on NATS JetStream. Errors use "
            "OpenAI's shape. The WebSocket bridge (`/v1/ws`; browsers authenticate it with "
            "a ticket from `POST /v1/ws/tickets`) and the admin API (its own port) are not "
            "described here.",
        },
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key: `Authorization: Bearer <key>`.",
                }
            },
            "parameters": PARAMETERS,
            "responses": {
                name: error_response(status, text)
                for status, (name, text) in ERROR_RESPONSES.items()
            },
            "schemas": dict(sorted(schemas.items())),
        },
    }
    # As JSON has it (a tuple default is a list): the document equals what is served.
    plain: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(document))
    return plain


@functools.lru_cache(maxsize=8)
def _encoded(models: tuple[str, ...], embedding_models: tuple[str, ...]) -> bytes:
    return msgspec.json.encode(build_spec(models, embedding_models))


async def spec(request: Request) -> Response:
    """``GET /openapi.json``: the document of this deployment."""
    cfg = request.app.state.gateway.cfg
    body = _encoded(tuple(cfg.models), tuple(cfg.embedding_models))
    return Response(body, media_type="application/json")


def render() -> str:
    """``gateway/ingress/openapi.json``: the document for any deployment."""
    return msgspec.json.format(msgspec.json.encode(build_spec()), indent=2).decode() + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["-"]:
        sys.stdout.write(render())
    else:
        SHIPPED.write_text(render())

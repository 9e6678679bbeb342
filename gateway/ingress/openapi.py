"""The OpenAPI 3.1 description of the public (OpenAI-compatible) API.

``GET /openapi.json`` serves it. Request bodies and the ledger record are
generated from the msgspec Structs the gateway validates and writes
(:mod:`gateway.inference.openai_types`, :mod:`streams.request_ledger`), so the spec cannot drift
from the validation; the routes, responses and errors are written out here, one
entry for each status the code can answer with.

The served spec describes *this* deployment: ``model`` is an enum of the models
the gateway serves (chat and completions) or embeds. ``gateway/ingress/openapi.json`` is
the same document for any deployment (``model`` is any string); regenerate it
with ``python -m gateway.ingress.openapi > gateway/ingress/openapi.json``.

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
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.inference.openai_types import ChatRequest, CompletionRequest, EmbeddingRequest
from streams.request_ledger import LedgerRecord

Schema = dict[str, Any]

OPENAPI_VERSION = "3.1.0"
API_VERSION = "1"  # the public API's version, not the package's
REF = "#/components/schemas/{name}"
MAX_TIMEOUT_S = 600.0  # GatewayConfig.max_timeout_s, the default a deployment may lower


def _ref(name: str) -> Schema:
    return {"$ref": REF.format(name=name)}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


# -- components: generated from the Structs -------------------------------------------


def _struct_schemas() -> dict[str, Schema]:
    _, components = msgspec.json.schema_components(
        [ChatRequest, CompletionRequest, EmbeddingRequest, LedgerRecord], ref_template=REF
    )
    chat = components["ChatRequest"]
    # `messages` has a default only so the Struct can follow `_Common`'s defaults;
    # parse_body refuses a request without one, so it is required.
    chat["properties"]["messages"].pop("default", None)
    chat["required"] = sorted({*chat["required"], "messages"})
    for name in ("ChatRequest", "CompletionRequest", "EmbeddingRequest"):
        components[name]["properties"]["model"]["examples"] = [
            "sim-embed" if name == "EmbeddingRequest" else "sim-8b"
        ]
    components["ChatRequest"]["description"] = (
        "A chat completion request. Fields jetserve does not read pass through to the "
        "engine unchanged. `n` must be 1. Without `max_tokens` (or `max_completion_tokens`) "
        "the output is bounded by the gateway's default."
    )
    components["CompletionRequest"]["description"] = (
        "A (legacy) completion request: a prompt as text, token ids, or a batch of either. "
        "Without `max_tokens` the output is bounded at 16 tokens, as OpenAI's is."
    )
    components["EmbeddingRequest"]["description"] = (
        "An embeddings request. `base64` encodes each vector as little-endian float32."
    )
    components["WireUsage"] = components.pop("Usage")
    components["WireUsage"]["title"] = "WireUsage"
    components["WireUsage"]["description"] = "Token counts; a zero count is left out."
    components["LedgerRecord"]["properties"]["usage"] = _ref("WireUsage")
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


# -- components: responses, written out ----------------------------------------------

_INT0: Schema = {"type": "integer", "minimum": 0}

_RESPONSE_SCHEMAS: dict[str, Schema] = {
    "Error": {
        "type": "object",
        "description": "OpenAI's error shape: the openai SDKs raise their usual exceptions.",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string", "examples": ["invalid_request_error"]},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"], "examples": ["invalid_api_key"]},
                },
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
            }
        },
        "required": ["error"],
        "additionalProperties": False,
    },
    "CompletionUsage": {
        "type": "object",
        "properties": {
            "prompt_tokens": _INT0,
            "completion_tokens": _INT0,
            "total_tokens": _INT0,
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": _INT0},
                "required": ["cached_tokens"],
            },
        },
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    },
    "ToolCalls": {
        "type": "array",
        "description": "Tool calls as the engine produced them (OpenAI's shape).",
        "items": {"type": "object"},
    },
    "ChatCompletion": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^chatcmpl-"},
            "object": {"const": "chat.completion"},
            "created": _INT0,
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INT0,
                        "message": {
                            "type": "object",
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": ["string", "null"]},
                                "tool_calls": _ref("ToolCalls"),
                            },
                            "required": ["role", "content"],
                        },
                        "logprobs": {"type": "null"},
                        "finish_reason": {"type": "string", "examples": ["stop", "length"]},
                    },
                    "required": ["index", "message", "finish_reason"],
                },
            },
            "usage": _ref("CompletionUsage"),
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    },
    "Completion": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^cmpl-"},
            "object": {"const": "text_completion"},
            "created": _INT0,
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INT0,
                        "text": {"type": "string"},
                        "logprobs": {"type": "null"},
                        "finish_reason": {"type": "string"},
                    },
                    "required": ["index", "text", "finish_reason"],
                },
            },
            "usage": _ref("CompletionUsage"),
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    },
    "ChatCompletionChunk": {
        "type": "object",
        "description": "One `chat.completion.chunk`. The last one, with "
        "`stream_options.include_usage`, has no choices and carries `usage`.",
        "properties": {
            "id": {"type": "string", "pattern": "^chatcmpl-"},
            "object": {"const": "chat.completion.chunk"},
            "created": _INT0,
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INT0,
                        "delta": {
                            "type": "object",
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": "string"},
                                "tool_calls": _ref("ToolCalls"),
                            },
                        },
                        "logprobs": {"type": "null"},
                        "finish_reason": {"type": ["string", "null"]},
                    },
                    "required": ["index", "delta", "finish_reason"],
                },
            },
            "usage": _ref("CompletionUsage"),
        },
        "required": ["id", "object", "created", "model", "choices"],
    },
    "CompletionChunk": {
        "type": "object",
        "description": "One streamed `text_completion` chunk; the usage chunk has no choices.",
        "properties": {
            "id": {"type": "string", "pattern": "^cmpl-"},
            "object": {"const": "text_completion"},
            "created": _INT0,
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INT0,
                        "text": {"type": "string"},
                        "logprobs": {"type": "null"},
                        "finish_reason": {"type": ["string", "null"]},
                    },
                    "required": ["index", "text", "finish_reason"],
                },
            },
            "usage": _ref("CompletionUsage"),
        },
        "required": ["id", "object", "created", "model", "choices"],
    },
    "Embeddings": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "object": {"const": "embedding"},
                        "index": _INT0,
                        "embedding": {
                            "oneOf": [
                                {"type": "array", "items": {"type": "number"}},
                                {
                                    "type": "string",
                                    "contentEncoding": "base64",
                                    "description": "`encoding_format: base64`: "
                                    "little-endian float32",
                                },
                            ]
                        },
                    },
                    "required": ["object", "index", "embedding"],
                },
            },
            "model": {"type": "string"},
            "usage": {
                "type": "object",
                "properties": {"prompt_tokens": _INT0, "total_tokens": _INT0},
                "required": ["prompt_tokens", "total_tokens"],
            },
        },
        "required": ["object", "data", "model", "usage"],
    },
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "model"},
                        "created": _INT0,
                        "owned_by": {"type": "string"},
                    },
                    "required": ["id", "object", "created", "owned_by"],
                },
            },
        },
        "required": ["object", "data"],
    },
    "Health": {
        "type": "object",
        "properties": {"status": {"const": "ok"}},
        "required": ["status"],
    },
    "Readiness": {
        "type": "object",
        "properties": {
            "ready": {"type": "boolean"},
            "checks": {
                "type": "object",
                "description": "Each dependency (NATS, Redis, ...) and whether it answers.",
                "additionalProperties": {"type": "boolean"},
            },
        },
        "required": ["ready", "checks"],
    },
}


def _stream_event(description: str, *chunks: str) -> Schema:
    payloads = [_ref(c) for c in chunks] + [_ref("Error")]
    return {
        "type": "object",
        "description": description,
        "properties": {
            "event": {"const": "message"},
            "id": {
                "type": "string",
                "pattern": "^[0-9]+$",
                "description": "The last token's sequence number: send it back as "
                "`Last-Event-ID` to resume after it.",
            },
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": payloads},
                    },
                ]
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


# -- responses and parameters ---------------------------------------------------------

_ERROR_RESPONSES: dict[str, tuple[str, str]] = {
    # status: (component name, what it means)
    "400": ("BadRequest", "Bad body, invalid JSON, out-of-range parameter or header."),
    "401": ("Unauthorized", "Missing or unknown API key (`invalid_api_key`)."),
    "403": ("Forbidden", "The key's scopes do not allow this model, class, tool or data class."),
    "404": ("NotFound", "Unknown model (`model_not_found`), stream or path."),
    "408": ("ClientTooSlow", "The client read too slowly (`client_too_slow`)."),
    "413": ("RequestTooLarge", "The request exceeds the bus's message size (`request_too_large`)."),
    "429": (
        "RateLimited",
        "Rate limited or queue full (`rate_limit_exceeded`, `queue_full`, "
        "`engine_rate_limited`; with `Retry-After`), or budget spent (`insufficient_quota`/"
        "`budget_exceeded`; with `x-should-retry: false`).",
    ),
    "502": ("UpstreamFailed", "The engine failed (`upstream_error`, `stream_interrupted`)."),
    "503": ("Unavailable", "NATS, Redis or the engine is unavailable: the gateway fails closed."),
    "504": ("Timeout", "The request's deadline passed (`deadline_exceeded`)."),
}


def _error_response(status: str, description: str) -> Schema:
    response: Schema = {
        "description": description,
        "content": {"application/json": {"schema": _ref("Error")}},
    }
    if status == "429":
        response["headers"] = {
            "Retry-After": {
                "description": "Whole seconds to wait (rate limits and a full queue).",
                "schema": {"type": "integer", "minimum": 1},
            },
            "x-should-retry": {
                "description": "`false` when the budget is spent: retrying cannot help.",
                "schema": {"type": "string", "enum": ["false"]},
            },
        }
    return response


def _errors(*statuses: int) -> dict[str, Schema]:
    return {
        str(s): {"$ref": f"#/components/responses/{_ERROR_RESPONSES[str(s)][0]}"} for s in statuses
    }


_REQUEST_ID_HEADER: Schema = {
    "description": "The request's id (also in the ledger).",
    "schema": {"type": "string"},
}

_PARAMETERS: dict[str, Schema] = {
    "Class": {
        "name": "X-Jetserve-Class",
        "in": "header",
        "description": "The request class (queue) to use.",
        "schema": {"type": "string", "enum": ["interactive", "batch"], "default": "interactive"},
    },
    "Timeout": {
        "name": "X-Jetserve-Timeout",
        "in": "header",
        "description": "The request's absolute deadline, in seconds from now (default 120 s; "
        "the upper bound is the gateway's `--max-timeout`, 600 s by default).",
        "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S},
    },
    "DataClass": {
        "name": "X-Jetserve-Data-Class",
        "in": "header",
        "description": "What the request carries (e.g. `pii`), checked against the key's scopes.",
        "schema": {"type": "string", "default": "default"},
    },
    "IdempotencyKey": {
        "name": "Idempotency-Key",
        "in": "header",
        "description": "Non-streaming requests only: a retry with the same key and body gets "
        "the first response (`Idempotent-Replayed: true`) and is charged once.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    },
    "Traceparent": {
        "name": "traceparent",
        "in": "header",
        "description": "W3C trace context; a malformed value starts a new trace.",
        "schema": {"type": "string"},
    },
    "Tracestate": {
        "name": "tracestate",
        "in": "header",
        "description": "W3C trace state, forwarded (first 512 characters).",
        "schema": {"type": "string"},
    },
}


def _param(name: str) -> Schema:
    return {"$ref": f"#/components/parameters/{name}"}


def _inference(
    summary: str, body: str, json_schema: str, event_schema: str | None, op_id: str
) -> Schema:
    ok_content: Schema = {"application/json": {"schema": _ref(json_schema)}}
    if event_schema is not None:
        ok_content["text/event-stream"] = {"schema": _ref(event_schema)}
    params = [_param("Timeout"), _param("DataClass"), _param("IdempotencyKey")]
    params += [_param("Traceparent"), _param("Tracestate")]
    if event_schema is not None:
        params.insert(0, _param("Class"))
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "description": "Streaming responses (`stream: true`) are committed (200) at the "
            "first token, or after the gateway's `--commit-after` seconds in the queue; until "
            "then a failure is a real HTTP status, after it an SSE error event. A client that "
            "disconnects gets nothing (logged as 499) and the request is cancelled upstream."
            if event_schema is not None
            else "The request always goes to the `embed` class.",
            "parameters": params,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(body)}},
            },
            "responses": {
                "200": {
                    "description": "The result: JSON, or server-sent events with `stream: true`."
                    if event_schema is not None
                    else "The embeddings.",
                    "headers": {
                        "X-Request-Id": _REQUEST_ID_HEADER,
                        "Idempotent-Replayed": {
                            "description": "`true` on a replay of an Idempotency-Key.",
                            "schema": {"type": "string", "enum": ["true"]},
                        },
                    },
                    "content": ok_content,
                },
                **_errors(400, 401, 403, 404, 408, 413, 429, 502, 503, 504),
            },
        }
    }


def _run_op(op_id: str, summary: str, ok: str, statuses: tuple[int, ...]) -> Schema:
    """Agent-run routes (docs/agents.md): JSON in, JSON out; 409 for a decision
    on a call that is not pending."""
    responses: dict[str, Schema] = {
        ok: {
            "description": summary,
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
        **_errors(*statuses),
    }
    if 409 in statuses or op_id in ("decideRunCall",):
        responses["409"] = {
            "description": "The call is not pending, or the decision was already made.",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    return {"operationId": op_id, "summary": summary, "responses": responses}


def _run_paths() -> dict[str, Schema]:
    common = (400, 401, 403, 404, 429, 503)
    body = {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    return {
        "/v1/runs": {
            "post": {**_run_op("createRun", "A new agent run.", "201", common), "requestBody": body}
        },
        "/v1/runs/{run_id}": {"get": _run_op("getRun", "The run record.", "200", common)},
        "/v1/runs/{run_id}/events": {
            "get": {
                **_run_op("runEvents", "The run's events (SSE, resumable).", "200", common),
                "responses": {
                    "200": {
                        "description": "Server-sent events; resume with Last-Event-ID.",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    },
                    **_errors(*common),
                },
            }
        },
        "/v1/runs/{run_id}/approvals/{call_id}": {
            "post": {
                **_run_op("decideRunCall", "Approve or deny a paused tool call.", "200", common),
                "requestBody": body,
            }
        },
        "/v1/runs/{run_id}/cancel": {
            "post": _run_op("cancelRun", "Cancel the run and its descendants.", "200", common)
        },
    }


def _paths() -> dict[str, Schema]:
    public: list[dict[str, Any]] = [{}]  # no credential
    return {
        **_run_paths(),
        "/v1/chat/completions": _inference(
            "Chat completion",
            "ChatRequest",
            "ChatCompletion",
            "ChatStreamEvent",
            "createChatCompletion",
        ),
        "/v1/completions": _inference(
            "Completion",
            "CompletionRequest",
            "Completion",
            "CompletionStreamEvent",
            "createCompletion",
        ),
        "/v1/embeddings": _inference(
            "Embeddings", "EmbeddingRequest", "Embeddings", None, "createEmbedding"
        ),
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The models this gateway serves (chat and embedding).",
                "responses": {
                    "200": {
                        "description": "The models.",
                        "content": {"application/json": {"schema": _ref("ModelList")}},
                    },
                    **_errors(401, 503),
                },
            }
        },
        "/v1/ledger": {
            "get": {
                "operationId": "getLedger",
                "summary": "The key's tenant's ledger records, in append order.",
                "description": "One JSON record a line; never any prompt or completion text. "
                "The key decides the tenant: a `tenant` parameter is refused (400).",
                "parameters": [
                    {
                        "name": name,
                        "in": "query",
                        "description": text,
                        "schema": schema,
                    }
                    for name, text, schema in (
                        (
                            "since",
                            "Records created at or after (unix seconds).",
                            {"type": "number"},
                        ),
                        (
                            "until",
                            "Records created at or before (unix seconds).",
                            {"type": "number"},
                        ),
                        ("limit", "At most this many records.", {"type": "integer"}),
                    )
                ],
                "responses": {
                    "200": {
                        "description": "The records, as JSON lines.",
                        "content": {
                            "application/x-ndjson": {
                                "schema": {"type": "array", "items": _ref("LedgerRecord")}
                            }
                        },
                    },
                    **_errors(400, 401, 503),
                },
            }
        },
        "/v1/requests/{request_id}/stream": {
            "get": {
                "operationId": "resumeStream",
                "summary": "Resume a streaming request after `Last-Event-ID`, on any replica.",
                "description": "Replays the captured chunks after the given token sequence "
                "number, then follows the stream live. Only the key's own tenant's requests. "
                "Once committed (200), a failure (deadline, interruption, a client too slow) "
                "is an SSE error event.",
                "parameters": [
                    {
                        "name": "request_id",
                        "in": "path",
                        "required": True,
                        "description": "The `X-Request-Id` of the streaming request.",
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "Last-Event-ID",
                        "in": "header",
                        "description": "The last SSE event id the client received (0: from the "
                        "start).",
                        "schema": {"type": "integer", "default": 0},
                    },
                    {
                        "name": "last_event_id",
                        "in": "query",
                        "description": "`Last-Event-ID` for clients that cannot set headers.",
                        "schema": {"type": "integer"},
                    },
                    {
                        "name": "include_usage",
                        "in": "query",
                        "description": "`true` or `1`: end with a usage chunk.",
                        "schema": {"type": "string", "enum": ["true", "false", "1", "0"]},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "The rest of the stream.",
                        "headers": {"X-Request-Id": _REQUEST_ID_HEADER},
                        "content": {"text/event-stream": {"schema": _ref("ResumedStreamEvent")}},
                    },
                    **_errors(400, 401, 404, 503),
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "The process is alive.",
                "security": public,
                "responses": {
                    "200": {
                        "description": "Alive.",
                        "content": {"application/json": {"schema": _ref("Health")}},
                    }
                },
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "NATS and Redis are reachable.",
                "security": public,
                "responses": {
                    status: {
                        "description": text,
                        "content": {"application/json": {"schema": _ref("Readiness")}},
                    }
                    for status, text in (("200", "Ready."), ("503", "Not ready: see `checks`."))
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics (text exposition format).",
                "security": public,
                "responses": {
                    "200": {
                        "description": "The metrics.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document.",
                "security": public,
                "responses": {
                    "200": {
                        "description": "The OpenAPI document of this deployment.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
        "/playground": {
            "get": {
                "operationId": "playground",
                "summary": "A page that streams a chat from a browser (SSE and WebSocket).",
                "security": public,
                "responses": {
                    "200": {
                        "description": "The page, under a strict Content-Security-Policy.",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }


def build_spec(
    models: Sequence[str] | None = None, embedding_models: Sequence[str] | None = None
) -> dict[str, Any]:
    """The OpenAPI document. With ``models`` (and ``embedding_models``), ``model``
    is an enum of them: the document of one deployment."""
    schemas = _struct_schemas()
    if models is not None or embedding_models is not None:
        _with_models(schemas, models or (), embedding_models or ())
    schemas.update(_RESPONSE_SCHEMAS)
    schemas.update(_EVENT_SCHEMAS)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "jetserve",
            "version": API_VERSION,
            "description": "An OpenAI-compatible LLM gateway on NATS JetStream. Errors use "
            "OpenAI's shape. The WebSocket bridge (`/v1/ws`) and the admin API (its own "
            "port) are not described here.",
        },
        "security": [{"bearer": []}],
        "paths": _paths(),
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key: `Authorization: Bearer <key>`.",
                }
            },
            "parameters": _PARAMETERS,
            "responses": {
                name: _error_response(status, text)
                for status, (name, text) in _ERROR_RESPONSES.items()
            },
            "schemas": dict(sorted(schemas.items())),
        },
    }


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
    sys.stdout.write(render())

"""The public API's operations, as a declarative table, with the shared
parameters and error responses they refer to (``gateway/ingress/openapi.py``
puts them in the document)."""

from __future__ import annotations

from typing import Any

import msgspec

Schema = dict[str, Any]

REF = "#/components/schemas/{name}"
MAX_TIMEOUT_S = 600.0  # GatewayConfig.max_timeout_s, the default a deployment may lower
OBJECT: Schema = {"type": "object"}


def ref(name: str) -> Schema:
    return {"$ref": REF.format(name=name)}


# -- errors, headers and parameters ---------------------------------------------------

ERROR_RESPONSES: dict[int, tuple[str, str]] = {
    # status: (component name, what it means)
    400: ("BadRequest", "Bad body, invalid JSON, out-of-range parameter or header."),
    401: ("Unauthorized", "Missing or unknown API key (`invalid_api_key`)."),
    403: ("Forbidden", "The key's scopes do not allow this model, class, tool or data class."),
    404: ("NotFound", "Unknown model (`model_not_found`), stream or path."),
    408: ("ClientTooSlow", "The client read too slowly (`client_too_slow`)."),
    413: (
        "RequestTooLarge",
        "The body is over the gateway's cap (`--max-body-bytes`, 4 MiB by default; the "
        "connection is closed) or the bus's message size (`request_too_large`).",
    ),
    431: (
        "HeadersTooLarge",
        "Over 100 request headers, or over 64 KiB of request line and headers, by default "
        "(`request_headers_too_large`; the connection is closed).",
    ),
    429: (
        "RateLimited",
        "Rate limited or queue full (`rate_limit_exceeded`, `queue_full`, "
        "`engine_rate_limited`; with `Retry-After`), or budget spent (`insufficient_quota`/"
        "`budget_exceeded`; with `x-should-retry: false`).",
    ),
    502: ("UpstreamFailed", "The engine failed (`upstream_error`, `stream_interrupted`)."),
    503: ("Unavailable", "NATS, Redis or the engine is unavailable: the gateway fails closed."),
    504: ("Timeout", "The request's deadline passed (`deadline_exceeded`)."),
}
_RATE_LIMIT_HEADERS: Schema = {
    "Retry-After": {
        "description": "Whole seconds to wait (rate limits and a full queue).",
        "schema": {"type": "integer", "minimum": 1},
    },
    "x-should-retry": {
        "description": "`false` when the budget is spent: retrying cannot help.",
        "schema": {"type": "string", "enum": ["false"]},
    },
}
_REQUEST_ID_HEADER: Schema = {
    "description": "The request's id (also in the ledger).",
    "schema": {"type": "string"},
}
_REPLAYED_HEADER: Schema = {
    "description": "`true` on a replay of an Idempotency-Key.",
    "schema": {"type": "string", "enum": ["true"]},
}


def error_response(status: int, description: str) -> Schema:
    response = _response(description, {"application/json": ref("Error")})
    if status == 429:
        response["headers"] = _RATE_LIMIT_HEADERS
    return response


def _errors(*statuses: int) -> dict[str, Schema]:
    return {str(s): {"$ref": f"#/components/responses/{ERROR_RESPONSES[s][0]}"} for s in statuses}


def _param(where: str, name: str, description: str, schema: Schema, **extra: Any) -> Schema:
    return {"name": name, "in": where, "description": description, "schema": schema, **extra}


PARAMETERS: dict[str, Schema] = {
    "Class": _param(
        "header",
        "X-Jetserve-Class",
        "The request class (queue) to use.",
        {"type": "string", "enum": ["interactive", "batch"], "default": "interactive"},
    ),
    "Timeout": _param(
        "header",
        "X-Jetserve-Timeout",
        "The request's absolute deadline, in seconds from now (default 120 s; "
        "the upper bound is the gateway's `--max-timeout`, 600 s by default).",
        {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S},
    ),
    "DataClass": _param(
        "header",
        "X-Jetserve-Data-Class",
        "What the request carries (e.g. `pii`), checked against the key's scopes.",
        {"type": "string", "default": "default"},
    ),
    "IdempotencyKey": _param(
        "header",
        "Idempotency-Key",
        "Non-streaming requests only: a retry with the same key and body gets "
        "the first response (`Idempotent-Replayed: true`) and is charged once.",
        {"type": "string", "minLength": 1, "maxLength": 255},
    ),
    "Traceparent": _param(
        "header",
        "traceparent",
        "W3C trace context; a malformed value starts a new trace.",
        {"type": "string"},
    ),
    "Tracestate": _param(
        "header",
        "tracestate",
        "W3C trace state, forwarded (first 512 characters).",
        {"type": "string"},
    ),
}


# -- operations -----------------------------------------------------------------------


def _response(
    description: str, content: dict[str, Schema], headers: Schema | None = None
) -> Schema:
    out: Schema = {"description": description}
    if headers is not None:
        out["headers"] = headers
    out["content"] = {media: {"schema": schema} for media, schema in content.items()}
    return out


class Operation(msgspec.Struct, frozen=True, kw_only=True):
    """One path operation. ``params`` name shared parameters (components) or are
    parameter objects; ``body`` is the JSON request body's schema."""

    path: str
    method: str
    id: str
    summary: str
    description: str | None = None
    public: bool = False  # no credential
    params: tuple[str | Schema, ...] = ()
    body: Schema | None = None
    ok: dict[str, Schema]
    errors: tuple[int, ...] = ()

    def render(self) -> Schema:
        out: Schema = {"operationId": self.id, "summary": self.summary}
        if self.description is not None:
            out["description"] = self.description
        if self.public:
            out["security"] = [{}]
        if self.params:
            out["parameters"] = [
                {"$ref": f"#/components/parameters/{p}"} if isinstance(p, str) else p
                for p in self.params
            ]
        if self.body is not None:
            json_body = {"application/json": {"schema": self.body}}
            out["requestBody"] = {"required": True, "content": json_body}
        out["responses"] = {**self.ok, **_errors(*self.errors)}
        return out


_COMMITTED = (
    "Streaming responses (`stream: true`) are committed (200) at the first token, or "
    "after the gateway's `--commit-after` seconds in the queue; until then a failure is a "
    "real HTTP status, after it an SSE error event. A client that disconnects gets nothing "
    "(logged as 499) and the request is cancelled upstream."
)
_INFERENCE_PARAMS = ("Timeout", "DataClass", "IdempotencyKey", "Traceparent", "Tracestate")
_INFERENCE_ERRORS = (400, 401, 403, 404, 408, 413, 429, 431, 502, 503, 504)
_INFERENCE_HEADERS: Schema = {
    "X-Request-Id": _REQUEST_ID_HEADER,
    "Idempotent-Replayed": _REPLAYED_HEADER,
}


def _inference(path: str, op_id: str, summary: str, body: str, ok: str, event: str) -> Operation:
    return Operation(
        path=path,
        method="post",
        id=op_id,
        summary=summary,
        description=_COMMITTED,
        params=("Class", *_INFERENCE_PARAMS),
        body=ref(body),
        ok={
            "200": _response(
                "The result: JSON, or server-sent events with `stream: true`.",
                {"application/json": ref(ok), "text/event-stream": ref(event)},
                _INFERENCE_HEADERS,
            )
        },
        errors=_INFERENCE_ERRORS,
    )


_RUN_ERRORS = (400, 401, 403, 404, 429, 503)


def _run(
    path: str, method: str, op_id: str, summary: str, *, ok: str = "200", body: bool = False
) -> Operation:
    """Agent-run routes (docs/agents.md): JSON in, JSON out."""
    responses = {ok: _response(summary, {"application/json": OBJECT})}
    if op_id == "decideRunCall":
        responses["409"] = _response(
            "The call is not pending, or the decision was already made.",
            {"application/json": OBJECT},
        )
    return Operation(
        path=path,
        method=method,
        id=op_id,
        summary=summary,
        body=OBJECT if body else None,
        ok=responses,
        errors=_RUN_ERRORS,
    )


def _public(path: str, op_id: str, summary: str, ok: Schema) -> Operation:
    return Operation(path=path, method="get", id=op_id, summary=summary, public=True, ok=ok)


_LEDGER_WINDOW = tuple(
    _param("query", name, text, schema)
    for name, text, schema in (
        ("since", "Records created at or after (unix seconds).", {"type": "number"}),
        ("until", "Records created at or before (unix seconds).", {"type": "number"}),
        ("limit", "At most this many records.", {"type": "integer"}),
    )
)
_RESUME_PARAMS = (
    _param(
        "path",
        "request_id",
        "The `X-Request-Id` of the streaming request.",
        {"type": "string"},
        required=True,
    ),
    _param(
        "header",
        "Last-Event-ID",
        "The last SSE event id the client received (0: from the start).",
        {"type": "integer", "default": 0},
    ),
    _param(
        "query",
        "last_event_id",
        "`Last-Event-ID` for clients that cannot set headers.",
        {"type": "integer"},
    ),
    _param(
        "query",
        "include_usage",
        "`true` or `1`: end with a usage chunk.",
        {"type": "string", "enum": ["true", "false", "1", "0"]},
    ),
)

OPERATIONS: tuple[Operation, ...] = (
    _run("/v1/runs", "post", "createRun", "A new agent run.", ok="201", body=True),
    _run("/v1/runs/{run_id}", "get", "getRun", "The run record."),
    Operation(
        path="/v1/runs/{run_id}/events",
        method="get",
        id="runEvents",
        summary="The run's events (SSE, resumable).",
        ok={
            "200": _response(
                "Server-sent events; resume with Last-Event-ID.",
                {"text/event-stream": {"type": "string"}},
            )
        },
        errors=_RUN_ERRORS,
    ),
    _run(
        "/v1/runs/{run_id}/approvals/{call_id}",
        "post",
        "decideRunCall",
        "Approve or deny a paused tool call.",
        body=True,
    ),
    _run("/v1/runs/{run_id}/cancel", "post", "cancelRun", "Cancel the run and its descendants."),
    _inference(
        "/v1/chat/completions",
        "createChatCompletion",
        "Chat completion",
        "ChatRequest",
        "ChatCompletion",
        "ChatStreamEvent",
    ),
    _inference(
        "/v1/completions",
        "createCompletion",
        "Completion",
        "CompletionRequest",
        "Completion",
        "CompletionStreamEvent",
    ),
    Operation(
        path="/v1/embeddings",
        method="post",
        id="createEmbedding",
        summary="Embeddings",
        description="The request always goes to the `embed` class.",
        params=_INFERENCE_PARAMS,
        body=ref("EmbeddingRequest"),
        ok={
            "200": _response(
                "The embeddings.", {"application/json": ref("Embeddings")}, _INFERENCE_HEADERS
            )
        },
        errors=_INFERENCE_ERRORS,
    ),
    Operation(
        path="/v1/models",
        method="get",
        id="listModels",
        summary="The models this gateway serves (chat and embedding).",
        ok={"200": _response("The models.", {"application/json": ref("ModelList")})},
        errors=(401, 503),
    ),
    Operation(
        path="/v1/ws/tickets",
        method="post",
        id="createWsTicket",
        summary="A single-use ticket that opens the WebSocket bridge (`/v1/ws`) as this key.",
        description="For browsers, which cannot set headers on a WebSocket: the ticket "
        "is valid once, for `expires_in` seconds (30), and keeps the API key out of URLs. "
        "Send it as `?ticket=` or as the subprotocol `jetserve.bearer.<ticket>` offered "
        "with `jetserve.v1` (the server answers `jetserve.v1`). An unknown, expired or "
        "used ticket refuses the upgrade with 401 `invalid_ticket`.",
        ok={
            "200": _response(
                "The ticket.",
                {"application/json": ref("WsTicket")},
                {"Cache-Control": {"schema": {"type": "string", "enum": ["no-store"]}}},
            )
        },
        errors=(401, 503),
    ),
    Operation(
        path="/v1/ledger",
        method="get",
        id="getLedger",
        summary="The key's tenant's ledger records, in append order.",
        description="One JSON record a line; never any prompt or completion text. "
        "The key decides the tenant: a `tenant` parameter is refused (400).",
        params=_LEDGER_WINDOW,
        ok={
            "200": _response(
                "The records, as JSON lines.",
                {"application/x-ndjson": {"type": "array", "items": ref("LedgerRecord")}},
            )
        },
        errors=(400, 401, 503),
    ),
    Operation(
        path="/v1/requests/{request_id}/stream",
        method="get",
        id="resumeStream",
        summary="Resume a streaming request after `Last-Event-ID`, on any replica.",
        description="Replays the captured chunks after the given event id (every chunk "
        "has its own, increasing), then follows the stream live. Only the key's own "
        "tenant's requests. Once committed (200), a failure (deadline, interruption, a "
        "client too slow) is an SSE error event.",
        params=_RESUME_PARAMS,
        ok={
            "200": _response(
                "The rest of the stream.",
                {"text/event-stream": ref("ResumedStreamEvent")},
                {"X-Request-Id": _REQUEST_ID_HEADER},
            )
        },
        errors=(400, 401, 404, 503),
    ),
    _public(
        "/healthz",
        "healthz",
        "The process is alive.",
        {"200": _response("Alive.", {"application/json": ref("Health")})},
    ),
    _public(
        "/readyz",
        "readyz",
        "NATS and Redis are reachable.",
        {
            status: _response(text, {"application/json": ref("Readiness")})
            for status, text in (("200", "Ready."), ("503", "Not ready: see `checks`."))
        },
    ),
    _public(
        "/openapi.json",
        "openapi",
        "This document.",
        {
            "200": _response(
                "The OpenAPI document of this deployment.", {"application/json": OBJECT}
            )
        },
    ),
    _public(
        "/playground",
        "playground",
        "A page that streams a chat from a browser (SSE and WebSocket).",
        {
            "200": _response(
                "The page, under a strict Content-Security-Policy.",
                {"text/html": {"type": "string"}},
            )
        },
    ),
)

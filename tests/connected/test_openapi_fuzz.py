"""Bad HTTP input: schemathesis against the live gateway, through its real port.

The spec is the one the gateway serves (``GET /openapi.json``, checked equal to
:func:`gateway.ingress.openapi.build_spec` for the fleet's models). Every operation gets
the spec's examples, the coverage phase's boundary and negative cases, and a
bounded number of fuzzed ones, derandomized (a fixed seed): the same cases every
run. Each response must be no 5xx, with a documented status, content type and
headers, and a body (JSON, each SSE event, each ledger line) that matches the spec.

A few inputs that random generation is unlikely to hit (non-finite numbers,
subject wildcards as request ids) are sent explicitly, through the same checks.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from unittest.mock import Mock

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from gateway.ingress.app import create_app
from gateway.ingress.openapi import build_spec
from jetserve.fleet import Fleet

if TYPE_CHECKING:
    # schemathesis defines its OpenAPI case alias for type checkers only.
    from schemathesis.specs.openapi.schemas import OpenApiCase

pytestmark = pytest.mark.connected

MODELS = ["sim-8b"]  # FleetSpec.model
EMBEDDING_MODELS = ["sim-embed"]  # GatewayConfig.embedding_models
# A longer or different run: JETSERVE_FUZZ_SEED=7 JETSERVE_FUZZ_EXAMPLES=1000 pytest ...
SEED = int(os.environ.get("JETSERVE_FUZZ_SEED", "20261129"))
MAX_EXAMPLES = int(os.environ.get("JETSERVE_FUZZ_EXAMPLES", "100"))  # fuzzed, per operation
# A deadline this short may pass before a worker picks the request up: 504 is the
# documented answer then, not a server error.
SHORT_TIMEOUT_S = 5.0

CONFORMANCE = [
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
CHECKS = [not_a_server_error, *CONFORMANCE]

SPEC = build_spec(MODELS, EMBEDDING_MODELS)
CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": SEED,
        "generation": {
            "max-examples": MAX_EXAMPLES,
            "deterministic": True,
            "database": "none",
            "mode": "all",
            # The fleet's key is added to every call; 401s are tested on their own.
            "with-security-parameters": False,
        },
        # Nothing learnt from responses (ids, error messages): the same cases every run.
        "phases": {
            "examples": {"extra-data-sources": {"responses": False}},
            "coverage": {"extra-data-sources": {"responses": False}},
            "fuzzing": {
                "extra-data-sources": {"responses": False},
                "error-feedback": {"enabled": False},
            },
            "stateful": {"enabled": False},
        },
        "request-timeout": 20.0,
    }
)
# Agent runs are described (and covered by tests/connected/test_agent_runs.py) but
# not fuzzed here yet: their responses are only loosely specified.
schema = schemathesis.openapi.from_dict(copy.deepcopy(SPEC), config=CONFIG).exclude(
    path_regex="^/v1/runs"
)


@schemathesis.deserializer("application/x-ndjson")
def _ndjson(ctx: Any, response: Response) -> list[Any]:
    """The ledger: one JSON record a line, checked as an array (see gateway.ingress.openapi)."""
    return [json.loads(line) for line in response.content.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def auth(fleet: Fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.api_key}"}


def _short_deadline(case: OpenApiCase) -> bool:
    raw = case.headers.get("X-Jetserve-Timeout") if case.headers else None
    try:
        return raw is not None and float(raw) < SHORT_TIMEOUT_S
    except (TypeError, ValueError):
        return False


_calls = itertools.count(1)


def _fresh_idempotency_key(case: OpenApiCase) -> None:
    """Generated keys repeat ('0', 'a', ...) across cases with different bodies, which
    is a 400 `idempotency_key_reused` and would hide the rest of the request path:
    each call gets its own key (prefixed, so still 1-255 characters)."""
    key = case.headers.get("Idempotency-Key") if case.headers else None
    if isinstance(key, str) and 1 <= len(key) <= 255:
        case.headers["Idempotency-Key"] = f"{next(_calls)}-{key}"[:255]


def call_and_check(
    case: OpenApiCase, fleet: Fleet, auth: dict[str, str], *, with_key: bool = True
) -> Response:
    """Send the case with the fleet's key (unless it carries a credential of its own,
    or ``with_key`` is off), then run every check; a 504 passes the server-error
    check only for a short deadline (it must still be documented and well-formed)."""
    _fresh_idempotency_key(case)
    own = "Authorization" in (case.headers or {})
    headers = auth if with_key and not own else {}
    response = case.call(base_url=fleet.base_url, headers=headers, timeout=20.0)
    checks = CONFORMANCE if response.status_code == 504 and _short_deadline(case) else CHECKS
    case.validate_response(response, checks=checks, headers=headers)
    return response


def _conformance_test(path: str, method: str) -> Callable[..., None]:
    """The fuzz of one operation. A test function per operation, each with its own
    name: under pytest 9 every item that schemathesis's ``parametrize`` makes from
    one function has the same node id, and a parallel run (pytest-xdist, `make
    test`) runs one item per node id, so it fuzzed one operation out of 11."""

    def test(case: OpenApiCase, fleet: Fleet, auth: dict[str, str]) -> None:
        call_and_check(case, fleet, auth)

    fuzz = schema.include(path=path, method=method.upper()).parametrize()
    marked: Callable[..., None] = pytest.mark.slow(pytest.mark.timeout(120)(fuzz(test)))
    return marked


FUZZED = [
    (path, method)
    for path, methods in SPEC["paths"].items()
    if not path.startswith("/v1/runs")
    for method in methods
]
for _path, _method in FUZZED:
    _slug = re.sub(r"[^a-z0-9]+", "_", _path.lower()).strip("_")
    globals()[f"test_{_method}_{_slug}_conforms_to_its_spec"] = _conformance_test(_path, _method)


def test_the_served_spec_is_the_tested_one(fleet: Fleet) -> None:
    served = httpx.get(f"{fleet.base_url}/openapi.json", timeout=10.0)
    assert served.status_code == 200
    assert served.headers["content-type"] == "application/json"
    assert served.json() == SPEC


def test_every_public_route_is_described() -> None:
    """A route added to the app without a spec entry fails here (gateway/ingress/openapi.py)."""
    app = create_app(Mock())  # only reads attributes of the runtime
    routes = {
        (route.path, method)
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    spec = build_spec(MODELS, EMBEDDING_MODELS)  # fresh: the fuzz machinery may reshape SPEC
    described = {(path, m.upper()) for path, item in spec["paths"].items() for m in item}
    assert routes == described


@pytest.fixture(scope="module")
def streamed_id(fleet: Fleet, auth: dict[str, str]) -> str:
    """The id of a finished streaming request: its frames are resumable."""
    body = {
        "model": MODELS[0],
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello"}],
    }
    with httpx.stream(
        "POST", f"{fleet.base_url}/v1/chat/completions", json=body, headers=auth, timeout=20.0
    ) as r:
        assert r.status_code == 200
        assert r.read().endswith(b"data: [DONE]\n\n")
    return str(r.headers["x-request-id"])


RESUME = "/v1/requests/{request_id}/stream"


@pytest.mark.parametrize("last", ["0", "1", "3", "100000", "-1"])
def test_a_resumed_stream_conforms(
    fleet: Fleet, auth: dict[str, str], streamed_id: str, last: str
) -> None:
    case = schema[RESUME]["GET"].Case(
        path_parameters={"request_id": streamed_id},
        headers={"Last-Event-ID": last},
        query={"include_usage": "true"},
    )
    response = call_and_check(case, fleet, auth)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == [streamed_id]


@pytest.mark.parametrize("request_id", ["*", ">", "a.*", "a.>", "*.*", " ", "a b"])
def test_a_request_id_is_not_a_subject_pattern(
    fleet: Fleet, auth: dict[str, str], streamed_id: str, request_id: str
) -> None:
    """A wildcard is not an id: it must not resume some other request of the tenant."""
    case = schema[RESUME]["GET"].Case(path_parameters={"request_id": request_id})
    response = call_and_check(case, fleet, auth)
    assert response.status_code == 404, response.text[:300]


@pytest.mark.parametrize(
    "query",
    [
        {"limit": "nan"},
        {"limit": "inf"},
        {"limit": "-inf"},
        {"limit": "1e309"},
        {"limit": "0"},
        {"limit": "-1"},
        {"limit": "18014398509481984"},
        {"since": "nan"},
        {"since": "inf"},
        {"since": "-inf"},
        {"since": "1e20"},
        {"since": "-1e20"},
        {"since": "1e309"},
        {"until": "nan"},
        {"until": "1e309"},
        {"until": "-1e20"},
        {"since": "10", "until": "5"},
    ],
    ids=lambda q: "&".join(f"{k}={v}" for k, v in q.items()),
)
def test_ledger_window_edges(fleet: Fleet, auth: dict[str, str], query: dict[str, str]) -> None:
    """Numbers the fuzzer rarely sends: 200 or 400, never a 5xx."""
    case = schema["/v1/ledger"]["GET"].Case(query=query)
    call_and_check(case, fleet, auth)


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # `tools` items are free-form objects: a bad `function` is a 400, not a crash.
        pytest.param(CHAT, {"tools": [{"type": "function", "function": None}]}, id="tool-null"),
        pytest.param(CHAT, {"tools": [{"type": "function", "function": "f"}]}, id="tool-str"),
        pytest.param(CHAT, {"tools": [{"type": "function", "function": ["f"]}]}, id="tool-list"),
        pytest.param(CHAT, {"tools": [{"function": {"name": None}}]}, id="tool-name-null"),
        pytest.param(CHAT, {"tools": [{"function": {"name": {"x": 1}}}]}, id="tool-name-obj"),
        # Output bounds past what the budget store's integers hold: a 400, not a
        # 503 "accounting store unavailable" (which reads as Redis being down).
        pytest.param(CHAT, {"max_tokens": 10**20}, id="chat-max-tokens-1e20"),
        pytest.param(CHAT, {"max_completion_tokens": 10**23}, id="chat-max-completion-1e23"),
        pytest.param("/v1/completions", {"max_tokens": 10**30}, id="completion-max-tokens-1e30"),
    ],
)
def test_edge_bodies(fleet: Fleet, auth: dict[str, str], path: str, body: dict[str, Any]) -> None:
    """Valid by the spec, rare for the fuzzer: no 5xx, and a documented answer."""
    base: dict[str, Any] = {"model": MODELS[0], "max_tokens": 2}
    base.update({"messages": HI} if path == CHAT else {"prompt": "hi"})
    case = schema[path]["POST"].Case(body={**base, **body})
    call_and_check(case, fleet, auth)


SECURED: list[tuple[str, str, dict[str, Any]]] = [
    (CHAT, "POST", {"body": {"model": MODELS[0], "messages": HI}}),
    ("/v1/completions", "POST", {"body": {"model": MODELS[0], "prompt": "hi"}}),
    ("/v1/embeddings", "POST", {"body": {"model": EMBEDDING_MODELS[0], "input": "hi"}}),
    ("/v1/models", "GET", {}),
    ("/v1/ledger", "GET", {}),
    ("/v1/ws/tickets", "POST", {}),
    (RESUME, "GET", {"path_parameters": {"request_id": "0123456789abcdef"}}),
]


@pytest.mark.parametrize(("path", "method", "kwargs"), SECURED, ids=[p for p, _, _ in SECURED])
@pytest.mark.parametrize("credential", [None, "", "Bearer ", "Bearer sk-wrong", "Basic c2s6"])
def test_a_missing_or_wrong_key_is_401(
    fleet: Fleet,
    auth: dict[str, str],
    path: str,
    method: str,
    kwargs: dict[str, Any],
    credential: str | None,
) -> None:
    headers = {} if credential is None else {"Authorization": credential}
    case = schema[path][method].Case(headers=headers, **kwargs)
    response = call_and_check(case, fleet, auth, with_key=False)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_every_secured_operation_is_tested_for_401() -> None:
    secured = {
        (path, method.upper())
        for path, item in SPEC["paths"].items()
        for method, op in item.items()
        if all(op.get("security", SPEC["security"]))  # [{}]: no credential needed
        # Agent runs have their own 401 tests (tests/connected/test_agent_runs.py).
        and not path.startswith("/v1/runs")
    }
    assert secured == {(p, m) for p, m, _ in SECURED}

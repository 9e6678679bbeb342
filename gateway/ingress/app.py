"""The public (OpenAI-compatible) application over a shared :class:`Runtime`."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route, WebSocketRoute

from gateway import web
from gateway.errors import GatewayError
from gateway.ingress import api as http
from gateway.ingress import openapi, playground
from gateway.ingress import runs_http as runs
from gateway.ingress.ws import websocket_endpoint
from gateway.runtime import Runtime


def create_app(rt: Runtime) -> Starlette:
    routes = [
        Route("/v1/chat/completions", http.chat_completions, methods=["POST"]),
        Route("/v1/completions", http.completions, methods=["POST"]),
        Route("/v1/embeddings", http.embeddings, methods=["POST"]),
        Route("/v1/models", http.list_models, methods=["GET"]),
        Route("/v1/ledger", http.tenant_ledger, methods=["GET"]),
        Route("/v1/requests/{request_id}/stream", http.resume_stream, methods=["GET"]),
        Route("/v1/runs", runs.create_run, methods=["POST"]),
        Route("/v1/runs/{run_id}", runs.get_run, methods=["GET"]),
        Route("/v1/runs/{run_id}/events", runs.run_events, methods=["GET"]),
        Route("/v1/runs/{run_id}/approvals/{call_id}", runs.decide_call, methods=["POST"]),
        Route("/v1/runs/{run_id}/cancel", runs.cancel_run, methods=["POST"]),
        Route("/healthz", http.healthz, methods=["GET"]),
        Route("/readyz", http.readyz, methods=["GET"]),
        Route("/metrics", http.metrics, methods=["GET"]),
        Route("/playground", playground.page, methods=["GET"]),
        Route("/openapi.json", openapi.spec, methods=["GET"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={GatewayError: web.on_gateway_error, HTTPException: web.on_http_error},
    )
    app.state.gateway = rt.gateway
    app.state.readiness = rt.readiness
    app.state.refresh_queue_depth = rt.refresh_queue_depth
    app.state.ledger_reader = rt.ledger_reader
    app.state.runs = rt.runs
    return app

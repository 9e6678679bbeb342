"""The public (OpenAI-compatible) application over a shared :class:`Runtime`."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route, WebSocketRoute

from gateway import web
from gateway.errors import GatewayError
from gateway.ingress import api as http
from gateway.ingress import openapi, playground
from gateway.ingress import runs_http as runs
from gateway.ingress.ws import websocket_endpoint
from gateway.ingress.ws_auth import issue_ticket
from gateway.runtime import Runtime
from gateway.tenancy.tickets import TicketStore

log = logging.getLogger(__name__)


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
        Route("/playground", playground.page, methods=["GET"]),
        Route("/openapi.json", openapi.spec, methods=["GET"]),
        Route("/v1/ws/tickets", issue_ticket, methods=["POST"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={GatewayError: web.on_gateway_error, HTTPException: web.on_http_error},
    )
    app.state.gateway = rt.gateway
    app.state.readiness = rt.readiness
    app.state.ledger_reader = rt.ledger_reader
    app.state.runs = rt.runs
    app.state.tickets = TicketStore(rt.redis, rt.cfg.ws_ticket_ttl_s)
    if rt.cfg.ws_allow_query_key:
        log.warning(
            "--ws-allow-query-key: WebSocket clients may send their API key in the URL "
            "(?api_key=), where proxies and browser history keep it; prefer tickets"
        )
    return app

"""``/metrics`` on its own listener (``--metrics-port``, loopback by default),
never on the public port: queue depths, outcomes by class and allow-listed
tenant names are for the operator's Prometheus, not for every API client."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import web
from gateway.errors import GatewayError
from gateway.runtime import Runtime


async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    await rt.refresh_queue_depth()
    return Response(generate_latest(rt.gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_metrics_app(rt: Runtime) -> Starlette:
    app = Starlette(
        routes=[Route("/metrics", metrics, methods=["GET"])],
        exception_handlers={GatewayError: web.on_gateway_error, HTTPException: web.on_http_error},
    )
    app.state.rt = rt
    return app

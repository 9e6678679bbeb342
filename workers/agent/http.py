"""The executor's own small HTTP surface: /metrics, /healthz, /readyz (connected
to NATS). It runs inside the executor's task group and stops with it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.agent.executor import Executor


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the executor handles SIGTERM (drain); this server just follows


def create_app(executor: Executor) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(executor.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ok = executor.connected and executor.ready.is_set()
        body = {"ready": ok, "checks": {"nats": executor.connected}}
        return JSONResponse(body, 200 if ok else 503)

    return Starlette(
        routes=[Route("/metrics", metrics), Route("/healthz", healthz), Route("/readyz", readyz)]
    )


def server(executor: Executor, host: str, port: int) -> _Server:
    return _Server(
        uvicorn.Config(
            create_app(executor),
            host=host,
            port=port,
            loop="none",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
    )

"""The worker's own small HTTP surface: /metrics, /healthz, /readyz.

Readiness means what an operator needs: connected to NATS and the engine
answers its health probe. It runs inside the worker's task group, so it stops
with the worker (no thread, no signal handling of its own).
"""

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

from workers.worker import Worker


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the worker handles SIGTERM (drain); this server just follows


def create_app(worker: Worker) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        checks = {"nats": worker.connected, "engine": worker.engine_up}
        ok = all(checks.values())
        return JSONResponse({"ready": ok, "checks": checks}, 200 if ok else 503)

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
        ]
    )


def server(worker: Worker, host: str, port: int) -> _Server:
    return _Server(
        uvicorn.Config(
            create_app(worker),
            host=host,
            port=port,
            loop="none",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
    )

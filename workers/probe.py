"""The small HTTP surface of a worker or an agent executor: /metrics, /healthz,
/readyz. Readiness is what an operator needs: the owner's own checks (e.g.
NATS connected and the engine healthy); each owner builds its probe from
:func:`probe_server`. It runs inside the owner's task group, so it stops with
it (no thread, no signal handling of its own)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Checks = Callable[[], dict[str, bool]]


class ProbeServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the owner handles SIGTERM (drain); this server just follows


def probe_app(registry: CollectorRegistry, checks: Checks) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        results = checks()
        ok = all(results.values())
        return JSONResponse({"ready": ok, "checks": results}, 200 if ok else 503)

    return Starlette(
        routes=[Route("/metrics", metrics), Route("/healthz", healthz), Route("/readyz", readyz)]
    )


def probe_server(registry: CollectorRegistry, checks: Checks, host: str, port: int) -> ProbeServer:
    return ProbeServer(
        uvicorn.Config(
            probe_app(registry, checks),
            host=host,
            port=port,
            loop="none",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
    )

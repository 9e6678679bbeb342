"""The gateway application: one lifespan owns every connection and task."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as redis
from nats.js.errors import Error as JSError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route, WebSocketRoute

from gateway import http
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.errors import GatewayError
from gateway.ingress_nats import NatsIngress
from gateway.keys import KeyStore
from gateway.metrics import GatewayMetrics
from gateway.service import Gateway
from gateway.ws import websocket_endpoint
from streams.connect import connect
from streams.provision import ensure_topology


def create_app(cfg: GatewayConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nc = await connect(cfg.nats_url, f"gateway-{cfg.gateway_id}")
        # A bounded pool: bursts queue for a connection instead of opening thousands.
        pool = redis.BlockingConnectionPool.from_url(
            cfg.redis_url,
            max_connections=64,
            timeout=2.0,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
        )
        rds = redis.Redis(connection_pool=pool)
        try:
            js = nc.jetstream()
            await ensure_topology(js, cfg.topology)
            dispatcher = Dispatcher(nc, js, cfg.gateway_id, cfg.topology)
            await dispatcher.start()
            gw = Gateway(cfg, KeyStore(rds, cfg.key_cache_s), dispatcher, GatewayMetrics())
            ingress = NatsIngress(nc, gw)
            await ingress.start()

            async def readiness() -> dict[str, bool]:
                redis_ok = True
                try:
                    await rds.ping()
                except (RedisError, OSError):
                    redis_ok = False
                return {"nats": nc.is_connected, "redis": redis_ok}

            async def refresh_queue_depth() -> None:
                for cls in cfg.topology.classes:
                    try:
                        info = await js.consumer_info(
                            cfg.topology.stream, cfg.topology.consumer_name(cls), timeout=1.0
                        )
                    except (JSError, TimeoutError):
                        continue
                    depth = (info.num_pending or 0) + (info.num_ack_pending or 0)
                    gw.metrics.queue_depth.labels(cls.value).set(depth)

            app.state.gateway = gw
            app.state.readiness = readiness
            app.state.refresh_queue_depth = refresh_queue_depth
            yield
            await ingress.stop()
            await dispatcher.stop()
        finally:
            await rds.aclose()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(nc.drain(), 5)

    routes = [
        Route("/v1/chat/completions", http.chat_completions, methods=["POST"]),
        Route("/v1/completions", http.completions, methods=["POST"]),
        Route("/v1/embeddings", http.embeddings, methods=["POST"]),
        Route("/v1/models", http.list_models, methods=["GET"]),
        Route("/healthz", http.healthz, methods=["GET"]),
        Route("/readyz", http.readyz, methods=["GET"]),
        Route("/metrics", http.metrics, methods=["GET"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={GatewayError: http.on_gateway_error, HTTPException: http.on_http_error},
    )

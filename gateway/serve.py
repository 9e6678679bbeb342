"""Run a gateway process: one runtime, the public app, and the admin and
metrics apps on their own ports when configured, one signal handler that stops
them all gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from gateway.admin.app import create_admin_app
from gateway.config import GatewayConfig
from gateway.ingress.app import create_app
from gateway.ingress.http_protocol import protocol_class
from gateway.ingress.limits import RequestLimits
from gateway.ingress.ws_protocol import ws_protocol_class
from gateway.metrics_app import create_metrics_app
from gateway.runtime import open_runtime


class _NoQueryStrings(logging.Filter):
    """uvicorn logs each WebSocket upgrade at info with its path *and query
    string*: ``?ticket=wst-...``, or ``?api_key=sk-...`` where allowed, would land
    in the log. Those lines keep the path only; the handshake's dump at debug
    (its headers too) is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg[:2] in ("< ", "> "):
            # The websockets library's handshake dump at debug: the request line
            # and every header (Authorization, the bearer subprotocol).
            return False
        if isinstance(record.msg, str) and record.msg.startswith('%s - "WebSocket %s"'):
            args = record.args
            if isinstance(args, tuple) and len(args) >= 2 and isinstance(args[1], str):
                path, sep, _ = args[1].partition("?")
                record.args = (args[0], path + ("?..." if sep else ""), *args[2:])
        return True


_NO_QUERY_STRINGS = _NoQueryStrings()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Several servers share one process: signals are handled once, in serve().
        yield


def _config(
    cfg: GatewayConfig, app: ASGIApp, host: str, port: int, log_level: str, grace: float
) -> uvicorn.Config:
    # Every listener gets the request limits (gateway/ingress/limits.py) and the
    # bounded HTTP protocol (gateway/ingress/http_protocol.py): they cost a length
    # check per request, and an admin or metrics port is no reason to buffer 1 GB.
    limited = RequestLimits(app, max_body_bytes=cfg.max_body_bytes, max_headers=cfg.max_headers)
    return uvicorn.Config(
        limited,
        host=host,
        port=port,
        loop="none",
        http=protocol_class(
            cfg.max_header_bytes, cfg.client_send_buffer_bytes, cfg.request_read_timeout_s
        ),
        ws=ws_protocol_class(cfg.ws_send_timeout_s),
        # The WebSocket protocol's own bound: a longer message closes with 1009
        # before any of it reaches the app (it applies after decompression).
        ws_max_size=cfg.ws_max_message_bytes,
        timeout_keep_alive=round(cfg.keep_alive_s) or 1,
        lifespan="off",
        log_level=log_level,
        log_config=None,  # uvicorn's own lines go through the process's (JSON) handler
        access_log=False,
        timeout_graceful_shutdown=round(grace),
    )


def shared_socket(host: str, port: int) -> socket.socket:
    """The public listener with SO_REUSEPORT: several gateway processes bind the
    same port and the kernel spreads new connections over them (docs/bench.md,
    "Scale up on one node"). Each process keeps its own runtime and NATS/Redis
    connections; a connection stays with the process that accepted it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def serve(
    cfg: GatewayConfig,
    host: str,
    port: int,
    *,
    log_level: str = "warning",
    grace: float = 30.0,
    reuse_port: bool = False,
) -> None:
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _NO_QUERY_STRINGS not in uvicorn_log.filters:
        uvicorn_log.addFilter(_NO_QUERY_STRINGS)
    # Bound before the runtime opens, so a taken port fails at once.
    public = shared_socket(host, port) if reuse_port else None
    async with open_runtime(cfg) as rt:
        servers = [_Server(_config(cfg, create_app(rt), host, port, log_level, grace))]
        if cfg.admin_port is not None:
            admin = create_admin_app(rt, cfg.admin_token_sha256)
            servers.append(
                _Server(_config(cfg, admin, cfg.admin_host, cfg.admin_port, log_level, grace))
            )
        if cfg.metrics_port is not None:
            scrape = create_metrics_app(rt)
            servers.append(
                _Server(_config(cfg, scrape, cfg.metrics_host, cfg.metrics_port, log_level, grace))
            )

        def stop() -> None:
            for s in servers:
                s.should_exit = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        await asyncio.gather(
            servers[0].serve(sockets=[public] if public is not None else None),
            *(s.serve() for s in servers[1:]),
        )

"""Run a gateway process: one runtime, the public app and the admin app on
their own ports, one signal handler that stops both gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import uvicorn

from gateway.admin.app import create_admin_app
from gateway.config import GatewayConfig
from gateway.ingress.app import create_app
from gateway.runtime import open_runtime


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Two servers share one process: signals are handled once, in serve().
        yield


def _config(app: object, host: str, port: int, log_level: str, grace: float) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        loop="none",
        http="httptools",
        ws="websockets-sansio",
        lifespan="off",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=round(grace),
    )


async def serve(
    cfg: GatewayConfig, host: str, port: int, *, log_level: str = "warning", grace: float = 30.0
) -> None:
    async with open_runtime(cfg) as rt:
        servers = [_Server(_config(create_app(rt), host, port, log_level, grace))]
        if cfg.admin_port is not None:
            admin = create_admin_app(rt, cfg.admin_token_sha256)
            servers.append(
                _Server(_config(admin, cfg.admin_host, cfg.admin_port, log_level, grace))
            )

        def stop() -> None:
            for s in servers:
                s.should_exit = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        await asyncio.gather(*(s.serve() for s in servers))

"""NATS connection helper shared by every process."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)


async def connect(url: str, name: str) -> Client:
    async def on_error(exc: Exception) -> None:
        log.warning("nats %s: %s", name, exc)

    async def on_disconnect() -> None:
        # Also called on a deliberate close; reconnects are what matter.
        log.info("nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.warning("nats %s: reconnected", name)

    # A comma-separated list names the nodes of a cluster; any one will do.
    servers = [u.strip() for u in url.split(",") if u.strip()]
    return await nats.connect(
        servers,
        name=name,
        max_reconnect_attempts=-1,  # ride out a nats-server restart
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )

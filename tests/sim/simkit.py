"""Test helpers: a real simulator served by uvicorn on a free 127.0.0.1 port, in-process,
and SSE reading. Fixtures live in conftest.py; tests import helpers from here (a module
name of its own, since conftest modules from several directories share one name)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import uvicorn

from sim.app import create_app
from sim.cli import uvicorn_config
from sim.clock import Clock
from sim.config import SimConfig
from sim.simulator import Simulator


@dataclass
class SimHandle:
    url: str
    sim: Simulator
    client: httpx.AsyncClient

    async def stats(self) -> dict[str, Any]:
        r = await self.client.get("/sim/stats")
        r.raise_for_status()
        return dict(r.json())

    async def record(self, request_id: str) -> dict[str, Any]:
        r = await self.client.get(f"/sim/requests/{request_id}")
        r.raise_for_status()
        return dict(r.json())

    async def metric(self, name: str) -> float:
        """Sum of every sample of `name` in /metrics (over all label sets)."""
        r = await self.client.get("/metrics")
        r.raise_for_status()
        total, seen = 0.0, False
        for line in r.text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        assert seen, f"metric {name} missing"
        return total


@asynccontextmanager
async def serve(cfg: SimConfig, clock: Clock | None = None) -> AsyncIterator[SimHandle]:
    app = create_app(cfg, clock)
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets that say so,
    # and without it every response pays a 40 ms delayed-ACK stall.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn exited before starting")
            await asyncio.sleep(0.002)
        url = f"http://127.0.0.1:{port}"
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=50)
        async with httpx.AsyncClient(base_url=url, timeout=10.0, limits=limits) as client:
            yield SimHandle(url, app.state.sim, client)
    finally:
        await _stop(server, task)
        sock.close()
        app.state.sim.close()


async def _stop(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """Stop at once: uvicorn's own shutdown polls and sleeps ~0.2 s, on every test."""
    for listener in server.servers:
        listener.close()
    for conn in list(server.server_state.connections):
        conn.shutdown()
    pending = [t for t in server.server_state.tasks if not t.done()]
    for t in [*pending, task]:
        t.cancel()
    await asyncio.gather(*pending, task, return_exceptions=True)
    for listener in server.servers:
        await listener.wait_closed()


class Stream(msgspec.Struct):
    status: int
    events: list[dict[str, Any]]
    done: bool
    headers: dict[str, str]


async def sse(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Stream:
    """POST and read an SSE stream to its end."""
    events: list[dict[str, Any]] = []
    done = False
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return Stream(r.status_code, [r.json()], False, dict(r.headers))
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            assert not done, "data after [DONE]"
            events.append(msgspec.json.decode(data))
    return Stream(200, events, done, dict(r.headers))


def chat_body(content: str = "Hello there", **kw: Any) -> dict[str, Any]:
    return {"model": "sim-8b", "messages": [{"role": "user", "content": content}], **kw}


StartSim = Callable[..., Awaitable[SimHandle]]

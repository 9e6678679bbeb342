"""The gateway runtime's start and stop (gateway/runtime.py): a start that fails
halfway tears down what it had started."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig

import gateway.runtime
from gateway.config import GatewayConfig
from gateway.runtime import open_runtime
from jetserve.services import Service
from streams.auth import Role
from streams.connect import BusAuth, connect
from streams.errors import ProvisioningError
from streams.subjects import AGENT_STEP


def _filename(task: asyncio.Task[object]) -> str:
    code = getattr(task.get_coro(), "cr_code", None)
    return code.co_filename if code is not None else ""


async def _settled(before: set[asyncio.Task[object]], timeout_s: float = 30.0) -> set[str]:
    """The tasks started since ``before`` still alive when none is left or ``timeout_s``
    passed: a generous bound, since it returns as soon as the condition holds."""
    end = asyncio.get_running_loop().time() + timeout_s
    while True:
        # nats-py parks a consumer's heartbeat check on the loop until its own
        # timer fires, even after close; only tasks of our code count as leaks.
        alive = {
            task
            for task in asyncio.all_tasks() - before - {asyncio.current_task()}
            if "/nats/" not in _filename(task)
        }
        if not alive or asyncio.get_running_loop().time() > end:
            return {repr(task.get_coro()) for task in alive}
        await asyncio.sleep(0.05)


async def test_failed_start_tears_down_what_started(
    nats_server: Service, redis_server: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    # A stream that already holds the agent step subject: the runs' store cannot
    # be provisioned, after the dispatcher, route table, queue watch and the
    # NATS ingress have started.
    admin = await connect(url, "blocker", nats_server.bus_auth())
    await admin.jetstream().add_stream(StreamConfig(name="BLOCKER", subjects=[AGENT_STEP]))
    opened: list[Client] = []

    async def recording_connect(nats_url: str, name: str, auth: BusAuth) -> Client:
        nc = await connect(nats_url, name, auth)
        opened.append(nc)
        return nc

    monkeypatch.setattr(gateway.runtime, "connect", recording_connect)
    cfg = GatewayConfig(
        nats_url=url,
        redis_url=redis_server.redis_url("gateway"),
        nats_auth=nats_server.bus_auth(Role.GATEWAY),
        key_secret=b"k" * 32,
    )
    before = asyncio.all_tasks()
    try:
        with pytest.raises(ProvisioningError):
            async with open_runtime(cfg):
                pytest.fail("the runtime must not open")
        assert len(opened) == 1
        assert opened[0].is_closed
        assert await _settled(before) == set()
    finally:
        await admin.close()

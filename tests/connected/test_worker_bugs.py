"""A bug below the worker (an engine adapter raising what no adapter may) ends
the request at once, in one ``internal_error``, instead of leaving its client
waiting for its deadline. The worker runs in this process, in front of the
fleet's real simulator, through an adapter with a bug; the gateway, NATS and
Redis are the fleet's real processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
import pytest

from jetserve.cli import build_parser
from jetserve.commands.worker import worker_config
from jetserve.fleet import Fleet
from streams.auth import Role
from streams.tasks import stop_task
from streams.wire import Op
from workers.engines.base import Delta, Done, Embeddings
from workers.engines.openai import OpenAIAdapter
from workers.inference.worker import Worker

pytestmark = pytest.mark.connected


class BuggyAdapter(OpenAIAdapter):
    """The engine answers; the adapter then fails on it with a ``KeyError``."""

    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        await super().embed(body, request_id, headers)
        raise KeyError("usage")

    async def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        async for event in super().generate(op, body, request_id, headers):
            if isinstance(event, Delta | Done):  # its first event: before the first token
                raise KeyError("choices")
            yield event


async def test_a_bug_in_the_adapter_ends_each_request_at_once(
    make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = make_fleet(workers=0)
    assert fleet.creds is not None
    for name, value in fleet.creds.nats_env(Role.WORKER).items():
        monkeypatch.setenv(name, value)
    # Embeddings batched (the simulator runs each call alone): a batch's bug
    # reaches every member.
    args = build_parser().parse_args(
        ["worker", "--nats", fleet.nats_url, "--engine", fleet.sim_url, "--embed-batching", "on"]
    )
    cfg = await worker_config(args, fleet.sim_url)
    async with BuggyAdapter(fleet.sim_url) as engine:
        worker = Worker(cfg, engine)
        running = asyncio.create_task(worker.run())
        try:
            await worker.ready.wait()
            auth = {"Authorization": f"Bearer {fleet.api_key}"}
            async with httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as c:
                embeds = [
                    c.post(
                        "/v1/embeddings",
                        json={"model": "sim-embed", "input": f"text {i}"},
                        headers=auth,
                    )
                    for i in range(3)
                ]
                chat = c.post(
                    "/v1/chat/completions",
                    json={"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}]},
                    headers=auth,
                )
                answers = await asyncio.gather(*embeds, chat)
        finally:
            await worker.shutdown()
            await stop_task(running)
    for r in answers:
        assert r.status_code == 502, r.text  # the worker's 500, an upstream failure here
        error = r.json()["error"]
        assert error["code"] == "internal_error"
        assert "KeyError" in error["message"]
        assert "usage" not in error["message"]  # the bug's message stays in the worker
        assert "choices" not in error["message"]
    assert worker.embed_batcher.engine_calls >= 1

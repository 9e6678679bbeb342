"""One work-queue stream per request class (``gateway --class-streams``,
docs/scale.md), and each lane class's stream split by lane (``--lane-shards``),
through real processes: each class's requests are stored in its own streams,
the queue depths and `jetserve scale` read all of them, workers and a
deployment pool follow the fleet's layout without being told, and every
request is answered."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest
from nats.js.errors import NotFoundError

from jetserve.fleet import Fleet
from streams.auth import Role
from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import RequestClass
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = pytest.mark.connected

QUEUED = {RequestClass.INTERACTIVE: 8, RequestClass.BATCH: 2}
# A long system prompt sends a request to a prefix-affinity lane; 8 of them
# spread over the lanes (and so over the shards).
SYSTEM = "You are the assistant of a large shop; answer briefly and politely. " * 8


async def call(c: httpx.AsyncClient, fleet: Fleet, cls: RequestClass, i: int, model: str) -> int:
    messages = [
        {"role": "system", "content": f"{i} {SYSTEM}"},
        {"role": "user", "content": f"{i}"},
    ]
    body = {"model": model, "max_tokens": 4, "messages": messages}
    headers = {
        "Authorization": f"Bearer {fleet.api_key}",
        "X-Jetserve-Class": cls.value,
        "X-Jetserve-Timeout": "60",
    }
    r = await c.post(f"{fleet.base_url}/v1/chat/completions", json=body, headers=headers)
    return r.status_code


@pytest.mark.parametrize("shards", [1, 2])
async def test_each_class_has_its_own_streams_and_everything_is_served(
    make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    fleet = make_fleet(
        workers=0, class_streams=True, lane_shards=shards, sim_args=["--alias", "r-pooled"]
    )
    split = DEFAULT_TOPOLOGY.split(True, shards)

    def streams_of(cls: RequestClass) -> list[str]:
        return [n for n in split.request_streams if n.startswith(split.stream_of(cls))]

    nc = await fleet.connect()
    js = nc.jetstream()
    try:
        with pytest.raises(NotFoundError):
            await js.stream_info(DEFAULT_TOPOLOGY.stream)  # no shared stream
        assert len(streams_of(RequestClass.INTERACTIVE)) == shards
        for name in split.request_streams:
            info = await js.stream_info(name)
            assert info.config.metadata is not None
            assert info.config.metadata["jetserve_class_streams"] == "1"

        async with httpx.AsyncClient(timeout=90) as c:
            calls = [
                asyncio.create_task(call(c, fleet, cls, i, "sim-8b"))
                for cls, n in QUEUED.items()
                for i in range(n)
            ]

            async def per_stream() -> dict[str, int]:
                return {n: (await js.stream_info(n)).state.messages for n in split.request_streams}

            async def stored() -> bool:
                counts = await per_stream()
                return {cls: sum(counts[n] for n in streams_of(cls)) for cls in QUEUED} == QUEUED

            await until(stored, "each class's requests in its own streams")
            # Every shard of a sharded class took some of the 8 lanes' requests.
            counts = await per_stream()
            assert all(counts[n] for n in streams_of(RequestClass.INTERACTIVE)), counts

            async def depths() -> bool:
                text = (await c.get(fleet.gateway_metrics_urls[0])).text
                got = {
                    cls: metric_sum(text, "jetserve_queue_depth", cls=cls.value) for cls in QUEUED
                }
                return got == QUEUED

            await until(depths, "the gateway's queue depth to read every class stream")

            # `jetserve scale`, as an operator runs it, finds the layout by itself.
            assert fleet.creds is not None
            monkeypatch.setenv("JETSERVE_NATS_SEED_FILE", str(fleet.creds.seed_file(Role.ADMIN)))
            argv = [sys.executable, "-m", "jetserve", "scale", "--json", "--nats", fleet.nats_url]
            proc = await asyncio.to_thread(
                subprocess.run, argv, capture_output=True, text=True, timeout=30, check=False
            )
            assert proc.returncode == 0, proc.stderr
            rows = {r["class"]: r for r in json.loads(proc.stdout)["classes"]}
            assert {cls: rows[cls.value]["lag"] for cls in QUEUED} == QUEUED

            # A worker, told nothing of the layout, follows it and serves the queue.
            await asyncio.to_thread(fleet.start_worker, wait=False)
            assert await asyncio.gather(*calls) == [200] * sum(QUEUED.values())

            # A deployment pool's consumers live in the class streams too.
            await asyncio.to_thread(fleet.start_worker, "--deployment-name", "dep-p", wait=False)
            route = {
                "name": "r-pooled",
                "candidates": [
                    {"name": "dep-p", "adapter": "openai", "engine": "jetserve-sim",
                     "model": "r-pooled"},
                ],
            }  # fmt: skip
            r = await c.put(
                f"{fleet.admin_url}/admin/routes/r-pooled",
                json=route,
                headers={"Authorization": f"Bearer {fleet.admin_token}"},
            )
            assert r.status_code in (200, 201), r.text

            async def pooled() -> bool:
                return await call(c, fleet, RequestClass.INTERACTIVE, 9, "r-pooled") == 200

            await until(pooled, "a routed request served by the pool's worker")
            names = {i.name for i in await js.consumers_info(split.stream_of("interactive"))}
            assert any(n.startswith("pool-") for n in names), sorted(names)[:5]
    finally:
        await nc.close()

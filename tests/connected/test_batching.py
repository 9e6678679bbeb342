"""Embedding micro-batching end to end: 32 concurrent /v1/embeddings requests
through the gateway reach the engine in far fewer calls, and each client still
gets exactly what a call of its own would have returned (vectors and usage)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected

N = 32


def texts() -> list[str]:
    # Different lengths, so a wrong usage split cannot pass by symmetry.
    return [" ".join(f"word{i}-{j}" for j in range(1 + i % 7)) for i in range(N)]


async def embed_calls(c: httpx.AsyncClient, fleet: Fleet) -> int:
    r = await c.get(f"{fleet.sim_url}/sim/stats")
    r.raise_for_status()
    return int(r.json()["embeddings"])


async def fire(c: httpx.AsyncClient, fleet: Fleet) -> tuple[list[dict[str, Any]], float]:
    auth = {"Authorization": f"Bearer {fleet.api_key}"}

    async def one(text: str) -> dict[str, Any]:
        r = await c.post(
            f"{fleet.base_url}/v1/embeddings",
            json={"model": "sim-embed", "input": text},
            headers=auth,
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    t0 = time.monotonic()
    out = await asyncio.gather(*(one(t) for t in texts()))
    return out, time.monotonic() - t0


async def test_concurrent_embeddings_are_batched_and_exact(
    make_fleet: Callable[..., Fleet],
) -> None:
    # A window wide enough for the burst: on a loaded 2-core box the 32 requests
    # reach the worker spread over a few hundred ms (25 ms once gave 13 calls).
    fleet = make_fleet(workers=1, profile="h100-8b", worker_args=["--embed-batch-delay-ms", "250"])
    async with httpx.AsyncClient(timeout=30) as c:
        direct = []
        for text in texts():
            r = await c.post(
                f"{fleet.sim_url}/v1/embeddings", json={"model": "sim-embed", "input": text}
            )
            r.raise_for_status()
            direct.append(r.json())
        await fire(c, fleet)  # warm: connections, consumers
        before = await embed_calls(c, fleet)
        got, batched_s = await fire(c, fleet)
        batched_calls = await embed_calls(c, fleet) - before

        for mine, ref in zip(got, direct, strict=True):
            assert mine["data"][0]["embedding"] == ref["data"][0]["embedding"]
            assert mine["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
            assert mine["usage"]["total_tokens"] == ref["usage"]["total_tokens"]
        assert batched_calls <= N // 4, batched_calls

        r = await c.get(f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics")
        counts = [
            float(line.rsplit(" ", 1)[1])
            for line in r.text.splitlines()
            if line.startswith("jetserve_worker_embed_batch_size_count")
        ]
        assert counts
        assert counts[0] >= batched_calls

        # The same fleet with batching off: one engine call per request.
        fleet.workers[0].stop()
        fleet.start_worker("--embed-batch-max", "1")
        await fire(c, fleet)
        before = await embed_calls(c, fleet)
        unbatched, single_s = await fire(c, fleet)
        single_calls = await embed_calls(c, fleet) - before
        assert single_calls == N
        assert [u["data"][0]["embedding"] for u in unbatched] == [
            g["data"][0]["embedding"] for g in got
        ]
    print(
        f"\n{N} concurrent embeddings: batched {batched_calls} engine calls in "
        f"{batched_s * 1000:.0f} ms; --embed-batch-max 1: {single_calls} calls in "
        f"{single_s * 1000:.0f} ms (x{single_s / batched_s:.2f} wall)"
    )

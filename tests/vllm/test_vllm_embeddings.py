"""Embeddings on a real model (issue 17): all-MiniLM-L6-v2 on vLLM's pooling
runner, which reports one KV block. Before, the worker's admission budgeted that
block, had 0 slots and never pulled: no embedding was served at all. Through a
fleet, the vectors are bit-identical to vLLM's own and `prompt_tokens` exact,
for one input and for eight, with micro-batching off (the default for vLLM) and
on, where the model's own tokenizer counts each request's share in-process."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet, FleetSpec
from tests.vllm.vllmkit import VllmServer
from workers.engines.openai import OpenAIAdapter
from workers.inference.token_count import LocalTokenCounter

PEERS = Path(os.environ.get("JETSERVE_VLLM_PEERS") or Path.home() / ".cache/jetserve-peers")
MINILM = Path(os.environ.get("JETSERVE_MINILM_DIR") or PEERS / "minilm/all-MiniLM-L6-v2")
TEXTS = [
    "one input to embed",
    "Hello, WORLD! naive cafe, naïve café: 東京 🙂",
    "",
    " ".join(["word"] * 200),  # past the 128 the tokenizer file truncates and pads to
    "The quick brown fox jumps over the lazy dog. " * 3,
]

pytestmark = [pytest.mark.vllm, pytest.mark.connected, pytest.mark.timeout(300)]


def test_embeddings_through_a_fleet_equal_vllms_own(vllm_embed_server: VllmServer) -> None:
    url, model = vllm_embed_server.url, vllm_embed_server.model
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'num_gpu_blocks="1"' in metrics  # the engine this is about
    bodies: list[dict[str, Any]] = [
        {"model": model, "input": "one input to embed"},
        {"model": model, "input": [f"input number {i} of a batch" for i in range(8)]},
    ]
    direct = [httpx.post(f"{url}/v1/embeddings", json=b, timeout=60).json() for b in bodies]
    spec = FleetSpec(
        workers=1, engine_url=url, model=model, gateway_args=["--embedding-models", model]
    )
    relayed = relay(spec, bodies)
    for mine, theirs in zip(relayed, direct, strict=True):
        assert [d["embedding"] for d in mine["data"]] == [d["embedding"] for d in theirs["data"]]
        assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]


def relay(spec: FleetSpec, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with Fleet(spec) as fleet, httpx.Client(timeout=60) as c:
        auth = {"Authorization": f"Bearer {fleet.api_key}"}
        listed = [
            m["id"] for m in c.get(f"{fleet.base_url}/v1/models", headers=auth).json()["data"]
        ]
        assert "sim-embed" not in listed  # nothing serves it here
        return [
            c.post(f"{fleet.base_url}/v1/embeddings", json=b, headers=auth).json() for b in bodies
        ]


def test_the_models_tokenizer_counts_as_vllm_does(vllm_embed_server: VllmServer) -> None:
    url, model = vllm_embed_server.url, vllm_embed_server.model
    counter = LocalTokenCounter(MINILM)
    with httpx.Client(timeout=60) as c:
        engine = [
            c.post(f"{url}/v1/embeddings", json={"model": model, "input": t}).json()["usage"][
                "prompt_tokens"
            ]
            for t in TEXTS
        ]
    assert counter.count_now(TEXTS) == engine  # [CLS] and [SEP] included, never truncated
    assert engine[2] == 2  # an empty input is [CLS] [SEP]


async def test_auto_leaves_batching_to_vllm(vllm_embed_server: VllmServer) -> None:
    async with OpenAIAdapter(vllm_embed_server.url) as engine:
        assert await engine.batches_embeddings() is True


def test_batched_through_a_fleet_with_local_counts_is_exact(
    vllm_embed_server: VllmServer,
) -> None:
    url, model = vllm_embed_server.url, vllm_embed_server.model
    bodies: list[dict[str, Any]] = [{"model": model, "input": t} for t in TEXTS] + [
        {"model": model, "input": [f"input number {i} of a batch" for i in range(8)]}
    ]
    direct = [httpx.post(f"{url}/v1/embeddings", json=b, timeout=60).json() for b in bodies]
    spec = FleetSpec(
        workers=1,
        engine_url=url,
        model=model,
        gateway_args=["--embedding-models", model],
        worker_args=[
            "--embed-batching",
            "on",
            "--embed-batch-delay-ms",
            "50",
            "--tokenizer",
            str(MINILM),
        ],
    )
    with Fleet(spec) as fleet:
        auth = {"Authorization": f"Bearer {fleet.api_key}"}

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(
                    *(
                        c.post(f"{fleet.base_url}/v1/embeddings", json=b, headers=auth)
                        for b in bodies
                    )
                )

        relayed = [r.json() for r in asyncio.run(together())]
        batched = httpx.get(f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics").text
    for mine, theirs in zip(relayed, direct, strict=True):
        assert [d["embedding"] for d in mine["data"]] == [d["embedding"] for d in theirs["data"]]
        assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    calls = [
        ln for ln in batched.splitlines() if ln.startswith("jetserve_worker_embed_batch_size_count")
    ]
    sums = [
        ln for ln in batched.splitlines() if ln.startswith("jetserve_worker_embed_batch_size_sum")
    ]
    assert calls
    assert sums
    assert float(calls[0].split()[-1]) < float(sums[0].split()[-1])  # some calls merged

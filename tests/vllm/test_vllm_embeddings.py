"""Embeddings on a real model (issue 17): all-MiniLM-L6-v2 on vLLM's pooling
runner, which reports one KV block. Before, the worker's admission budgeted that
block, had 0 slots and never pulled: no embedding was served at all. Through a
fleet, the vectors are bit-identical to vLLM's own and `prompt_tokens` exact,
for one input and for eight."""

from __future__ import annotations

import httpx
import pytest

from jetserve.fleet import Fleet, FleetSpec
from tests.vllm.vllmkit import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.connected, pytest.mark.timeout(300)]


def test_embeddings_through_a_fleet_equal_vllms_own(vllm_embed_server: VllmServer) -> None:
    url, model = vllm_embed_server.url, vllm_embed_server.model
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'num_gpu_blocks="1"' in metrics  # the engine this is about
    bodies = [
        {"model": model, "input": "one input to embed"},
        {"model": model, "input": [f"input number {i} of a batch" for i in range(8)]},
    ]
    direct = [httpx.post(f"{url}/v1/embeddings", json=b, timeout=60).json() for b in bodies]
    spec = FleetSpec(
        workers=1, engine_url=url, model=model, gateway_args=["--embedding-models", model]
    )
    with Fleet(spec) as fleet, httpx.Client(timeout=60) as c:
        auth = {"Authorization": f"Bearer {fleet.api_key}"}
        listed = [
            m["id"] for m in c.get(f"{fleet.base_url}/v1/models", headers=auth).json()["data"]
        ]
        assert "sim-embed" not in listed  # nothing serves it here
        relayed = [
            c.post(f"{fleet.base_url}/v1/embeddings", json=b, headers=auth).json() for b in bodies
        ]
    for mine, theirs in zip(relayed, direct, strict=True):
        assert [d["embedding"] for d in mine["data"]] == [d["embedding"] for d in theirs["data"]]
        assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]

"""The affinity key (gateway/inference/lanes.py) includes the LoRA adapter: one
prompt under two adapters hashes apart (their KV blocks are not shared), and a
base model's lanes are what they were before adapters."""

from __future__ import annotations

import hashlib

from gateway.inference.lanes import LaneRouter
from streams.definitions import Topology
from streams.routes import RoutingPolicy
from streams.subjects import pool_lane_subject

PROMPTS = [f"You are assistant number {i} of the shop; answer briefly. " * 8 for i in range(16)]


def lane(router: LaneRouter, prompt: str, adapter: str = "") -> str:
    body = {"messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "q"}]}
    return router.subject(
        "chat", "interactive", "acme", body, RoutingPolicy(), pool="p", adapter=adapter
    )


def test_the_adapter_is_part_of_the_prefix_key() -> None:
    router = LaneRouter(Topology())
    base = [lane(router, p) for p in PROMPTS]
    a = [lane(router, p, "sql-lora") for p in PROMPTS]
    b = [lane(router, p, "chat-lora") for p in PROMPTS]
    assert a == [lane(router, p, "sql-lora") for p in PROMPTS]  # stable
    assert a != base
    assert a != b
    # The base model's key is the one it had before adapters: tenant, prompt head.
    head = PROMPTS[0][: RoutingPolicy().prefix_chars]
    digest = hashlib.blake2b(f"acme\0{head}".encode(), digest_size=8).digest()
    expected = int.from_bytes(digest, "big") % Topology().pool_lanes
    assert base[0] == pool_lane_subject("p", "interactive", expected)

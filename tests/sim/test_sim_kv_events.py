"""The simulator's KV cache events decode as vLLM's (``vllm/distributed/kv_events.py``,
the array-like shape of v0.9 to v0.11), over ZMQ as vLLM sends them."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from sim.config import SimConfig
from sim.kv import BlockManager
from sim.kv_events import KvEventSink, offset_endpoint
from sim.replicas import replica_configs
from tests.sim.simkit import chat_body, serve


# vLLM's types, as its own subscriber example declares them (not the simulator's).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


vllm_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def test_block_manager_events_decode_as_vllms() -> None:
    sink = KvEventSink()
    kv = BlockManager(num_blocks=4, block_size=2, events=sink)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = [11, 12, 13]
    got = kv.allocate(hashes, 3, 0, tokens)
    assert got is not None
    batch = sink.take()
    assert batch is not None
    decoded = vllm_decoder.decode(msgspec.msgpack.encode(batch))
    [stored] = decoded.events  # one run of one sequence: one event
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == hashes
    assert stored.parent_block_hash is None
    assert stored.token_ids == tokens
    assert stored.block_size == 2
    assert stored.medium == "GPU"
    kv.free(got[0])
    # A new sequence needs 3 blocks: one free, two evicted (its tail first).
    other = kv.allocate([21, 22, 23], 3, 0, [7, 8, 9, 10, 11, 12])
    assert other is not None
    decoded = vllm_decoder.decode(msgspec.msgpack.encode(sink.take()))
    kinds = [type(e).__name__ for e in decoded.events]
    assert kinds == ["BlockRemoved", "BlockStored"]
    removed = decoded.events[0]
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [13, 12]


def test_replica_endpoints_follow_vllms_port_offset() -> None:
    cfg = SimConfig(kv_events_endpoint="tcp://*:5557")
    eps = [c.kv_events_endpoint for c in replica_configs(cfg, 3)]
    assert eps == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_2"


@pytest.mark.asyncio
async def test_served_requests_publish_vllm_batches_over_zmq() -> None:
    cfg = SimConfig(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_topic="kv-events")
    async with serve(cfg) as h:
        assert h.sim.kv_publisher is not None
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(h.sim.kv_publisher.endpoint)
        try:
            # A PUB drops what it sends before the SUB has joined: send (new
            # prompts, so new blocks) until a batch arrives.
            n = 0
            async with asyncio.timeout(10):
                while not await sub.poll(timeout=50):
                    n += 1
                    prompt = " ".join(f"word{n}x{i}" for i in range(200))
                    r = await h.client.post(
                        "/v1/chat/completions", json=chat_body(prompt, max_tokens=2)
                    )
                    assert r.status_code == 200
                topic, seq, payload = await sub.recv_multipart()
        finally:
            sub.close(linger=0)
    assert topic == b"kv-events"
    assert len(seq) == 8
    batch = vllm_decoder.decode(payload)
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert stored
    assert stored[0].block_size == 16
    assert len(stored[0].token_ids) == 16 * len(stored[0].block_hashes)

"""KV-headroom admission: slots, block budget, engine correction, class ranks."""

from __future__ import annotations

import asyncio

from workers.engines.base import EngineLoad
from workers.engines.vllm_metrics import parse_vllm_metrics
from workers.inference.admission import Admission, AdmissionConfig


async def test_slots_bounded_by_max_inflight() -> None:
    adm = Admission(AdmissionConfig(max_inflight=2, reserve=0))
    assert await adm.acquire(0)
    assert await adm.acquire(0)
    assert adm.free_slots() == 0
    third = asyncio.create_task(adm.acquire(0))
    await asyncio.sleep(0.05)
    assert not third.done()
    await adm.release()
    assert await asyncio.wait_for(third, 1)


async def test_kv_blocks_limit_slots() -> None:
    cfg = AdmissionConfig(
        max_inflight=64, num_gpu_blocks=100, block_size=16, typical_tokens=160, target_util=1.0
    )
    adm = Admission(cfg)
    assert adm.free_slots() == 10  # 100 blocks / 10 blocks per typical request
    await adm.reserve_blocks(16 * 50)
    assert adm.free_slots() == 5


async def test_engine_queue_stops_pulling() -> None:
    adm = Admission(AdmissionConfig(max_inflight=8))
    assert await adm.acquire(0)
    await adm.observe(EngineLoad(waiting=3, kv_usage=0.2))
    assert adm.free_slots() == 0
    await adm.observe(EngineLoad(waiting=0, kv_usage=0.95))
    assert adm.free_slots() == 0
    await adm.observe(EngineLoad(waiting=0, kv_usage=0.1))
    assert adm.free_slots() == 7


async def test_lower_class_leaves_reserve_until_starved() -> None:
    adm = Admission(AdmissionConfig(max_inflight=2, reserve=1, starve_after=0.3))
    assert await adm.acquire(0)  # one held: one free
    batch = asyncio.create_task(adm.acquire(2))
    await asyncio.sleep(0.1)
    assert not batch.done()  # the last slot is kept for interactive ...
    assert await asyncio.wait_for(batch, 2)  # ... until batch has waited starve_after


def test_parse_vllm_metrics() -> None:
    text = """
# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:num_requests_running{model_name="m"} 5.0
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096",model_name="m"} 1.0
"""
    load = parse_vllm_metrics(text)
    assert (load.waiting, load.running, load.kv_usage) == (2.0, 5.0, 0.25)
    assert (load.num_gpu_blocks, load.block_size) == (4096, 16)

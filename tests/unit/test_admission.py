"""KV-headroom admission: slots, block budget, engine correction, class ranks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest

from tests.waits import until, until_true
from workers.engines.base import EngineLoad
from workers.engines.vllm_metrics import parse_vllm_metrics
from workers.errors import WorkerStopping
from workers.inference.admission import Admission, AdmissionConfig


async def test_slots_bounded_by_max_inflight() -> None:
    adm = Admission(AdmissionConfig(max_inflight=2, reserve=0))
    assert await adm.acquire(0)
    assert await adm.acquire(0)
    assert adm.free_slots() == 0
    third = asyncio.create_task(adm.acquire(0))
    await until_true(lambda: adm.waiters == 1, "the third acquire waiting")
    assert not third.done()
    await adm.release()
    assert await asyncio.wait_for(third, 10)


async def test_kv_blocks_limit_slots() -> None:
    cfg = AdmissionConfig(
        max_inflight=64, num_gpu_blocks=100, block_size=16, typical_tokens=160, target_util=1.0
    )
    adm = Admission(cfg)
    assert adm.free_slots() == 10  # 100 blocks / 10 blocks per typical request
    await adm.reserve_blocks(16 * 50)
    assert adm.free_slots() == 5


async def test_a_pulled_request_reserves_its_own_blocks_and_waits_its_turn() -> None:
    cfg = AdmissionConfig(max_inflight=64, num_gpu_blocks=100, block_size=16, target_util=1.0)
    adm = Admission(cfg)
    small = await adm.reserve_blocks(16 * 60)  # 60 blocks in flight
    assert small == 60
    # 50 more blocks do not fit (110 > 100): the big one waits, and nothing more
    # is pulled meanwhile.
    assert not adm.fits_now(16 * 50)
    big = asyncio.create_task(adm.reserve_blocks(16 * 50))
    await asyncio.sleep(0)
    assert not big.done()
    assert adm.free_slots() == 0
    # A small one that would fit does not overtake it: arrival order.
    assert not adm.fits_now(16)
    later = asyncio.create_task(adm.reserve_blocks(16))
    await asyncio.sleep(0)
    assert not later.done()
    await adm.release(small)  # the 60 free: the big one first, then the small one
    assert await asyncio.wait_for(big, 1) == 50
    assert await asyncio.wait_for(later, 1) == 1
    assert adm.reserved_blocks == 51


async def test_a_request_larger_than_the_budget_runs_alone() -> None:
    adm = Admission(AdmissionConfig(num_gpu_blocks=100, block_size=16, target_util=0.9))
    assert adm.fits_now(16 * 500)  # nothing reserved: it runs, the engine copes
    assert await adm.reserve_blocks(16 * 500) == 500
    assert not adm.fits_now(16)  # and nothing joins it


async def test_a_cancelled_wait_for_blocks_reserves_nothing() -> None:
    adm = Admission(AdmissionConfig(num_gpu_blocks=10, block_size=16, target_util=1.0))
    held = await adm.reserve_blocks(16 * 8)
    waiting = asyncio.create_task(adm.reserve_blocks(16 * 5))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert adm.reserved_blocks == held
    assert adm.fits_now(16 * 2)  # the queue is empty again


async def test_closing_hands_back_the_requests_waiting_for_blocks() -> None:
    adm = Admission(AdmissionConfig(num_gpu_blocks=10, block_size=16, target_util=1.0))
    held = await adm.reserve_blocks(16 * 8)
    waiting = asyncio.create_task(adm.reserve_blocks(16 * 5))
    await asyncio.sleep(0)
    await adm.close()
    with pytest.raises(WorkerStopping):
        await waiting
    assert adm.reserved_blocks == held
    with pytest.raises(WorkerStopping):  # and one that comes later, not fitting
        await adm.reserve_blocks(16 * 5)
    assert await adm.reserve_blocks(16) == 1  # one that fits is served: the drain


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
    # One step of the loop runs batch to its wait (nothing before it sleeps); the
    # checks below do not yield, so batch cannot turn starved meanwhile, however
    # slow the box.
    await asyncio.sleep(0)
    assert adm.in_turn_waiters[2] == 1
    assert not batch.done()
    # The last slot is kept for interactive: an unstarved batch puller gets none ...
    assert not adm.try_acquire(2)
    assert adm.held == 1
    # ... until batch has waited starve_after (the timeout is only a hang guard).
    assert await asyncio.wait_for(batch, 10)
    assert (adm.held, adm.held_lower) == (2, 1)


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


async def test_data_parallel_engine_cores_read_as_one_engine_with_their_blocks() -> None:
    """vLLM with two data-parallel cores labels each core's gauges (``engine``).
    Summed, their KV usage read 0.95 at 48% and 47%: the worker stopped pulling at
    half the engine's capacity; and the blocks were the last core's alone."""
    text = """
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.48
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.47
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4096",model_name="m"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="4096",model_name="m"} 1.0
"""
    load = parse_vllm_metrics(text)
    assert load.kv_usage == pytest.approx(0.475)
    assert (load.waiting, load.running) == (0.0, 7.0)
    assert (load.num_gpu_blocks, load.block_size) == (8192, 16)
    adm = Admission(AdmissionConfig(max_inflight=16))
    await adm.observe(load)
    assert adm.free_slots() > 0  # room in both cores: it pulls


async def _until(cond: Callable[[], bool]) -> None:
    """Until ``cond`` holds (the waits poll on their own timer: a condition, not a sleep)."""

    async def check() -> bool:
        return cond()

    await until(check, "the admission state")


async def test_interactive_first_and_batch_kept_to_its_floor_when_starved() -> None:
    cfg = AdmissionConfig(max_inflight=4, reserve=1, lower_share=0.25, starve_after=0.2)
    adm = Admission(cfg)
    assert adm.lower_floor() == 1
    for _ in range(4):
        assert await adm.acquire(0)  # interactive holds every slot
    batch = asyncio.create_task(adm.acquire(3))
    more = asyncio.create_task(adm.acquire(0))  # and wants more
    await _until(lambda: adm.starved_lower == 1 and adm.top_waiters == 1)
    # A slot frees: the starved batch puller is below its floor, so it gets it,
    # even though interactive is waiting (batch always progresses).
    await adm.release(rank=0)
    await asyncio.wait_for(batch, 5)
    assert adm.held_lower == 1
    assert not more.done()
    # Another frees: batch is at its floor now, so interactive comes first.
    batch2 = asyncio.create_task(adm.acquire(3))
    await _until(lambda: adm.starved_lower == 1)
    await adm.release(rank=0)
    await asyncio.wait_for(more, 5)
    assert not batch2.done()
    batch2.cancel()
    await asyncio.gather(batch2, return_exceptions=True)
    assert adm.starved_lower == 0


async def test_the_floor_is_a_share_of_time_not_a_whole_slot() -> None:
    now = [0.0]
    cfg = AdmissionConfig(max_inflight=4, reserve=1, lower_share=0.05, starve_after=0.2)
    adm = Admission(cfg, clock=lambda: now[0])
    for _ in range(4):
        assert await adm.acquire(0)
    batch = asyncio.create_task(adm.acquire(3))
    more = asyncio.create_task(adm.acquire(0))
    await _until(lambda: adm.starved_lower == 1 and adm.top_waiters == 1)
    await adm.release(rank=0)
    await asyncio.wait_for(batch, 5)  # nothing used yet: the starved batch goes first
    now[0] = 10.0  # batch held a quarter of the slots for 10 s: far past 5 %
    await adm.release(rank=3)
    await asyncio.wait_for(more, 5)
    assert adm.lower_share_recent() > 0.15
    # A starved batch puller now waits behind interactive although it holds no
    # slot: its class had its share of the last seconds.
    batch2 = asyncio.create_task(adm.acquire(3))
    again = asyncio.create_task(adm.acquire(0))
    await _until(lambda: adm.starved_lower == 1 and adm.top_waiters == 1)
    await adm.release(rank=0)
    await asyncio.wait_for(again, 5)
    assert not batch2.done()
    # Once the share has decayed under 5 %, the next slot is batch's again.
    now[0] = 40.0
    assert adm.lower_share_recent() < 0.05
    await adm.release(rank=0)
    await asyncio.wait_for(batch2, 5)
    assert adm.held_lower == 1


async def test_with_16_slots_the_excess_leaves_a_spare_for_the_next_in_turn() -> None:
    adm = Admission(AdmissionConfig(max_inflight=16, reserve=1, starve_after=60))
    assert adm.cfg.spare() == 1
    assert adm.try_acquire(0)  # the in-turn puller's slot, held while it polls
    taken = 0
    while adm.try_acquire(0, excess=True):
        taken += 1
    assert taken == 14  # the flood: all but the polling puller's and one spare
    # A request in turn starts in the puller's slot; the puller's next is there.
    assert adm.try_acquire(0)
    assert Admission(AdmissionConfig(max_inflight=4)).cfg.spare() == 0


async def test_the_cushion_grows_with_the_requests_in_turn_running() -> None:
    adm = Admission(AdmissionConfig(max_inflight=16, reserve=1, starve_after=60))
    assert adm.try_acquire(0)  # the in-turn puller's slot
    while adm.try_acquire(0, excess=True):
        pass
    # A request in turn starts in the puller's slot; the puller takes the spare.
    assert adm.try_acquire(0)
    assert adm.free_slots() == 0
    # As the flood's requests end, the excess leaves two free now, not one: the
    # tenant with a request running finds two slots for its next ones.
    for _ in range(2):
        await adm.release(rank=0, excess=True)
        assert not adm.try_acquire(0, excess=True)
    await adm.release(rank=0, excess=True)
    assert adm.try_acquire(0, excess=True)
    assert adm.free_slots() == 2
    # It grows to twice the spare at most: 8 in turn running leave 1 + 1 + 2.
    for _ in range(2):
        assert adm.try_acquire(0)
    while adm.held_excess:
        await adm.release(rank=0, excess=True)
    for _ in range(6):
        assert adm.try_acquire(0)
    while adm.try_acquire(0, excess=True):
        pass
    assert adm.free_slots() == 3


async def test_batch_uses_idle_slots_but_not_past_an_interactive_waiter() -> None:
    adm = Admission(AdmissionConfig(max_inflight=4, reserve=1, starve_after=60))
    for _ in range(3):
        assert adm.try_acquire(3)  # nothing else wants them: batch may have them
    assert not adm.try_acquire(3)  # the reserve stays free
    assert adm.try_acquire(0)
    waiter = asyncio.create_task(adm.acquire(0))
    await _until(lambda: adm.top_waiters == 1)
    await adm.release(rank=3)  # freed by batch: interactive's
    await asyncio.wait_for(waiter, 5)
    assert adm.held_lower == 2


async def test_a_class_excess_yields_every_slot_to_the_class_in_turn() -> None:
    adm = Admission(AdmissionConfig(max_inflight=4, reserve=1, starve_after=60))
    assert adm.try_acquire(0)  # the in-turn puller's slot, held while it polls
    for _ in range(3):
        assert adm.try_acquire(0, excess=True)  # a flood's excess takes what is free
    assert not adm.try_acquire(0, excess=True)
    # The in-turn puller started its request and wants the next slot: it waits,
    # and the excess takes no slot while it does, not even one freed by the excess.
    in_turn = asyncio.create_task(adm.acquire(0))
    await _until(lambda: adm.in_turn_waiters[0] == 1)
    excess = asyncio.create_task(adm.acquire(0, excess=True))
    await _until(lambda: adm.waiters == 2)
    await adm.release()
    await asyncio.wait_for(in_turn, 5)
    assert not excess.done()
    await adm.release()  # no in-turn waiter now: the excess has it
    await asyncio.wait_for(excess, 5)
    assert adm.held == 4
    assert adm.in_turn_waiters[0] == 0
    # A lower class's in-turn puller does not hold back interactive's excess.
    batch = asyncio.create_task(adm.acquire(1))
    await _until(lambda: adm.in_turn_waiters[1] == 1)
    await adm.release()
    assert adm.try_acquire(0, excess=True)
    batch.cancel()
    await asyncio.gather(batch, return_exceptions=True)


async def test_with_one_slot_the_excess_still_runs_beside_the_polling_puller() -> None:
    adm = Admission(AdmissionConfig(max_inflight=1, reserve=1, starve_after=60))
    assert adm.try_acquire(0)  # the in-turn puller, polling
    assert adm.try_acquire(0, excess=True)  # one more: a flood is not starved
    assert not adm.try_acquire(0, excess=True)
    await adm.release(rank=0, excess=True)
    assert adm.held_excess == 0
    assert adm.held == 1


async def test_a_lower_class_excess_never_counts_as_starved() -> None:
    # One slot: interactive waits for it while a lower class's excess waits too.
    # Counted as starved, the excess would make interactive leave the slot free
    # for it, and the excess yields to interactive: neither would ever have it.
    adm = Admission(AdmissionConfig(max_inflight=1, reserve=1, starve_after=0.05))
    assert adm.try_acquire(0)
    assert adm.try_acquire(1, excess=True)  # the one beside
    excess = asyncio.create_task(adm.acquire(1, excess=True))
    interactive = asyncio.create_task(adm.acquire(0))
    await _until(lambda: adm.in_turn_waiters[0] == 1)
    await asyncio.sleep(0.2)  # well past starve_after
    assert adm.starved_lower == 0
    await adm.release(rank=1, excess=True)
    await adm.release()
    await asyncio.wait_for(interactive, 5)
    excess.cancel()
    await asyncio.gather(excess, return_exceptions=True)


async def test_an_idle_excess_polls_only_as_a_lower_class_does() -> None:
    adm = Admission(AdmissionConfig(max_inflight=4, reserve=1, starve_after=60))
    for _ in range(3):
        assert adm.try_acquire(0)
    # One slot free: an excess whose last pull found nothing leaves it to the
    # class (polling an empty queue must not keep a slot from a saturated one)...
    assert not adm.try_acquire(0, excess=True, idle=True)
    # ...one with work takes it.
    assert adm.try_acquire(0, excess=True)
    await adm.release(rank=0, excess=True)
    await adm.release()
    assert adm.try_acquire(0, excess=True, idle=True)  # two free: it may poll


async def test_an_idle_excess_waiting_is_no_top_class_demand() -> None:
    # Embeddings (a lower class) hold all but the reserve; interactive's excess,
    # polling an empty subject, waits for two free. Counted as interactive
    # waiting, that held every embedding back for starve_after (issue 17: an
    # embedding worker sat with nothing in flight half the time).
    adm = Admission(AdmissionConfig(max_inflight=8, reserve=1, starve_after=60))
    assert adm.try_acquire(0)  # interactive's puller, polling
    for _ in range(6):
        assert adm.try_acquire(2)
    assert not adm.try_acquire(2)  # the reserve stays free
    excess = asyncio.create_task(adm.acquire(0, excess=True, idle=True))
    await until(lambda: _true(adm.waiters == 1), "the idle excess waiting")
    assert adm.top_waiters == 0
    await adm.release(rank=2)  # an embedding ends: two free
    assert await asyncio.wait_for(excess, 5)  # the excess polls with one ...
    await adm.release(rank=0, excess=True)  # ... and finds nothing
    assert adm.try_acquire(2)  # the next embedding starts now, not a minute later
    # An excess with work in sight is interactive demand like any other.
    assert adm.try_acquire(0)  # the last slot
    busy = asyncio.create_task(adm.acquire(0, excess=True))
    await until(lambda: _true(adm.top_waiters == 1), "the busy excess waiting")
    await adm.release(rank=2)
    assert await asyncio.wait_for(busy, 5)
    await adm.release(rank=0, excess=True)
    await adm.release()  # two free again
    assert not adm.try_acquire(2)  # interactive asked within starve_after


async def test_an_idle_puller_lets_a_freed_slot_go_to_an_eager_waiter() -> None:
    # One slot, held by a puller polling an empty subject; a held lane message
    # waits for it. On release the puller loops straight back to acquire: it
    # must not retake the slot ahead of the waiter (with as many polling pullers
    # as slots, the lane's messages never started).
    adm = Admission(AdmissionConfig(max_inflight=1, reserve=0))
    assert await adm.acquire(0)
    held_message = asyncio.create_task(adm.acquire(0))
    await until(lambda: _true(adm.eager_waiters[0] == 1), "the message waiting")
    await adm.release()
    assert not adm.try_acquire(0, idle=True)  # the idle puller yields
    again = asyncio.create_task(adm.acquire(0, idle=True))
    assert await asyncio.wait_for(held_message, 1)
    assert not again.done()
    await adm.release()
    assert await asyncio.wait_for(again, 1)  # no eager waiter left: its turn


async def test_idle_pullers_do_not_yield_to_each_other_or_to_a_lower_class() -> None:
    adm = Admission(AdmissionConfig(max_inflight=2, reserve=0))
    # Another idle puller waiting is no reason to wait: two idle ones would
    # each wait for the other while the slots stayed free.
    assert await adm.acquire(0, idle=True)
    assert await adm.acquire(0, idle=True)
    idle_waiter = asyncio.create_task(adm.acquire(0, idle=True))
    await until(lambda: _true(adm.waiters == 1), "the idle puller waiting")
    assert adm.eager_waiters[0] == 0
    await adm.release()
    assert await asyncio.wait_for(idle_waiter, 1)
    # A lower class's eager waiter does not hold back an idle top-class puller.
    await adm.release()
    await adm.release()
    assert await adm.acquire(0)
    lower = asyncio.create_task(adm.acquire(1))  # batch: needs the top class quiet
    await until(lambda: _true(adm.eager_waiters[1] == 1), "the batch puller waiting")
    assert adm.try_acquire(0, idle=True)
    await stop(lower)


async def _true(value: bool) -> bool:
    return value


async def stop(task: asyncio.Task[bool]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_an_engine_without_a_kv_cache_is_admitted_by_slots() -> None:
    # vLLM's pooling runner (all-MiniLM-L6-v2) reports num_gpu_blocks=1 and a busy
    # cache: budgeting that block gave 0 slots, and no embedding was ever pulled.
    adm = Admission(AdmissionConfig(max_inflight=8))
    await adm.observe(EngineLoad(num_gpu_blocks=1, block_size=16, kv_usage=1.0, waiting=0))
    assert adm.num_gpu_blocks is None
    assert adm.free_slots() == 8
    assert await adm.acquire(0)
    assert adm.free_slots() == 7  # a busy cache is no reason to stop: it is not one
    # Its waiting queue still is.
    await adm.observe(EngineLoad(num_gpu_blocks=1, block_size=16, waiting=3))
    assert adm.free_slots() == 0
    # A real KV cache is budgeted as before.
    await adm.release()
    await adm.observe(EngineLoad(num_gpu_blocks=100, block_size=16, kv_usage=0.0, waiting=0))
    assert adm.num_gpu_blocks == 100


async def test_the_engine_has_room_only_with_nothing_waiting_and_kv_to_spare() -> None:
    # What a worker at its --max-inflight asks before it says the cap, not the
    # engine, holds the batch back (workers/inference/worker.py, _note_cap).
    adm = Admission(AdmissionConfig(max_inflight=4, num_gpu_blocks=100, block_size=16))
    await adm.observe(EngineLoad(kv_usage=0.1, waiting=0))
    assert adm.engine_has_room()
    await adm.observe(EngineLoad(kv_usage=0.1, waiting=1))
    assert not adm.engine_has_room()  # the engine queues: it is the limit
    await adm.observe(EngineLoad(kv_usage=0.95, waiting=0))
    assert not adm.engine_has_room()  # its cache is past target
    await adm.observe(EngineLoad(kv_usage=0.1, waiting=0))
    await adm.reserve_blocks(16 * 85)  # 85 of the 90 budgeted blocks: a typical one no longer fits
    assert not adm.engine_has_room()
    # A pooling engine (vLLM reports one block, "full"): no KV cache to budget, so room.
    pooling = Admission(AdmissionConfig(max_inflight=4))
    await pooling.observe(EngineLoad(num_gpu_blocks=1, block_size=16, kv_usage=1.0, waiting=0))
    assert pooling.engine_has_room()
    assert pooling.engine.kv_usage is None  # what the worker's `capped` line reports

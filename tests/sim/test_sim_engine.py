"""The latency and capacity model seen from a client: prefix caching, batching, KV, aborts."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest

from sim.clock import VirtualClock
from sim.profiles import PROFILES
from tests.sim.simkit import SimHandle, StartSim, chat_body, sse
from tests.waits import until

LONG_SYSTEM = " ".join(f"rule{i}" for i in range(700))  # ~700 prompt tokens


async def _ttft(
    client: httpx.AsyncClient, body: dict[str, Any], rid: str
) -> tuple[float, dict[str, Any]]:
    """Seconds from sending the request to the first content token, and the usage chunk."""
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    headers = {"X-Request-Id": rid}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    assert first is not None
    return first, usage


async def test_prefix_cache_hit_lowers_ttft(start_sim: StartSim) -> None:
    # Model time: the engine's virtual clock, so TTFT is the model's, not the box's.
    h = await start_sim(profile="h100-8b", clock=VirtualClock())
    messages = [{"role": "system", "content": LONG_SYSTEM}]
    body = {
        "model": "sim-8b", "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    rid1, rid2 = uuid.uuid4().hex, uuid.uuid4().hex
    _, u1 = await _ttft(
        h.client, {**body, "messages": [*messages, {"role": "user", "content": "one"}]}, rid1
    )
    _, u2 = await _ttft(
        h.client, {**body, "messages": [*messages, {"role": "user", "content": "two"}]}, rid2
    )
    assert u1["prompt_tokens"] > 600
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert cached > 600
    assert cached % 16 == 0
    assert cached < u2["prompt_tokens"]
    # The API server's time, then one prefill step each: ~710 tokens is compute-bound
    # (~22 ms on an H100), the uncached tail of the repeat costs about one read of the
    # weights (~7.5 ms).
    p = PROFILES["h100-8b"]
    n1, n2 = u1["prompt_tokens"], u2["prompt_tokens"]
    first, repeat = (await h.record(rid1))["ttft_s"], (await h.record(rid2))["ttft_s"]
    first, repeat = first - p.frontend_s, repeat - p.frontend_s
    assert first == pytest.approx(p.step_time(n1, 1, n1), rel=0.04)  # +/- 3% step jitter
    assert repeat == pytest.approx(p.step_time(n2 - cached, 1, n2), rel=0.04)
    assert repeat < 0.5 * first
    assert await h.metric("vllm:prefix_cache_hits_total") == cached
    queries = await h.metric("vllm:prefix_cache_queries_total")
    assert queries == u1["prompt_tokens"] + u2["prompt_tokens"]


async def test_kv_usage_returns_to_zero_when_idle(start_sim: StartSim) -> None:
    h = await start_sim(profile="h100-8b")
    body = chat_body(LONG_SYSTEM, max_tokens=20)
    tasks = [
        asyncio.create_task(h.client.post("/v1/chat/completions", json={**body, "seed": i}))
        for i in range(4)
    ]
    busy = 0.0
    while not all(t.done() for t in tasks):
        busy = max(busy, await h.metric("vllm:kv_cache_usage_perc"))
        await asyncio.sleep(0.02)
    assert all(t.result().status_code == 200 for t in tasks)
    assert busy > 0.0
    assert await h.metric("vllm:kv_cache_usage_perc") == 0.0
    assert await h.metric("vllm:num_requests_running") == 0.0
    stats = await h.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["kv_blocks_cached"] > 0


async def test_waiting_queue_forms_above_max_num_seqs(start_sim: StartSim) -> None:
    h = await start_sim(profile="h100-8b", max_num_seqs=2)
    tasks = [
        asyncio.create_task(
            h.client.post("/v1/chat/completions", json=chat_body(f"q{i}", max_tokens=8))
        )
        for i in range(6)
    ]
    peak_waiting, peak_running = 0.0, 0.0
    while not all(t.done() for t in tasks):
        peak_waiting = max(peak_waiting, await h.metric("vllm:num_requests_waiting"))
        peak_running = max(peak_running, await h.metric("vllm:num_requests_running"))
        await asyncio.sleep(0.01)
    assert all(t.result().status_code == 200 for t in tasks)
    assert peak_waiting > 0
    assert peak_running == 2
    stats = await h.stats()
    assert stats["finished"] == 6
    assert stats["waiting"] == 0
    assert stats["running"] == 0


async def test_preemption_under_kv_pressure_still_completes(start_sim: StartSim) -> None:
    # 10 blocks of 16 tokens; 4 sequences that each grow to ~4-5 blocks must preempt.
    h = await start_sim(profile="fast", num_gpu_blocks=10)
    body = chat_body("short prompt here", max_tokens=56, ignore_eos=True)
    rs = await asyncio.gather(
        *(h.client.post("/v1/chat/completions", json={**body, "seed": i}) for i in range(4))
    )
    assert [r.json()["usage"]["completion_tokens"] for r in rs] == [56] * 4
    stats = await h.stats()
    assert stats["preemptions"] > 0
    assert stats["finished"] == 4
    assert stats["kv_blocks_used"] == 0
    # A preempted request's text is unaffected (recompute, not a different answer).
    solo = await h.client.post("/v1/chat/completions", json={**body, "seed": 0})
    assert (
        solo.json()["choices"][0]["message"]["content"]
        == (rs[0].json()["choices"][0]["message"]["content"])
    )


async def _wait_status(h: SimHandle, rid: str, status: str) -> dict[str, Any]:
    rec: dict[str, Any] = {}

    async def reached() -> bool:
        nonlocal rec
        r = await h.client.get(f"/sim/requests/{rid}")
        rec = dict(r.json()) if r.status_code == 200 else {}
        return rec.get("status") == status

    await until(reached, f"{rid} becoming {status}")
    return rec


async def _engine_round_trip(h: SimHandle) -> None:
    """A short request run to its end: every engine step in flight before it
    has emitted by the time it returns."""
    r = await h.client.post("/v1/chat/completions", json=chat_body("after", max_tokens=2))
    assert r.status_code == 200


async def test_disconnect_mid_stream_aborts_at_once(start_sim: StartSim) -> None:
    h = await start_sim(profile="h100-8b")
    rid = uuid.uuid4().hex
    body = chat_body(max_tokens=500, ignore_eos=True, stream=True)
    seen = 0
    async with h.client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
    ) as r:
        async for line in r.aiter_lines():
            seen += '"content"' in line
            if seen >= 4:
                break
    # Leaving the block closed the connection mid-stream.
    closed_at = time.time()
    rec = await _wait_status(h, rid, "aborted")
    assert rec["aborted_at"] is not None
    assert rec["aborted_at"] <= time.time()
    assert rec["aborted_at"] >= closed_at - 0.05
    generated = rec["generated_tokens"]
    assert 3 <= generated < 500  # stopped where the client left, not run on
    await _engine_round_trip(h)  # steps taken after the abort add nothing to it
    assert (await h.record(rid))["generated_tokens"] == generated
    stats = await h.stats()
    assert stats["aborted"] == 1
    assert stats["running"] == 0
    assert stats["kv_blocks_used"] == 0
    assert await h.metric("vllm:kv_cache_usage_perc") == 0.0


async def test_disconnect_non_stream_aborts(start_sim: StartSim) -> None:
    h = await start_sim(profile="h100-8b")
    rid = uuid.uuid4().hex
    try:
        await h.client.post(
            "/v1/chat/completions",
            json=chat_body(max_tokens=500, ignore_eos=True),
            headers={"X-Request-Id": rid},
            timeout=0.3,
        )
        raise AssertionError("a 500-token reply cannot arrive within 0.3 s")
    except httpx.ReadTimeout:
        pass
    rec = await _wait_status(h, rid, "aborted")
    generated = rec["generated_tokens"]
    assert generated < 500
    await _engine_round_trip(h)  # steps taken after the abort add nothing to it
    assert (await h.record(rid))["generated_tokens"] == generated
    assert (await h.stats())["kv_blocks_used"] == 0


async def test_disconnect_while_waiting_leaves_queue(start_sim: StartSim) -> None:
    h = await start_sim(profile="h100-8b", max_num_seqs=1)
    # Stalled after its first token, it holds the only slot until its client
    # leaves: the second request waits however slow the box.
    busy = asyncio.create_task(
        h.client.post(
            "/v1/chat/completions",
            json=chat_body(max_tokens=30, ignore_eos=True),
            headers={"X-Sim-Fault": "stall"},
        )
    )

    async def busy_running() -> bool:  # the busy request takes the only slot first
        return bool((await h.stats())["running"])

    await until(busy_running, "the busy request running")
    rid = uuid.uuid4().hex
    async with h.client.stream(
        "POST", "/v1/chat/completions", json=chat_body("waits", stream=True),
        headers={"X-Request-Id": rid},
    ) as r:  # fmt: skip
        assert r.status_code == 200  # headers go out before admission, as with vLLM
        await _wait_status(h, rid, "waiting")
        # In the queue once out of the API server (the profile's frontend_s).

        async def queued() -> bool:
            return bool((await h.stats())["waiting"] == 1)

        await until(queued, "the request in the engine's waiting queue")
    rec = await _wait_status(h, rid, "aborted")
    assert rec["generated_tokens"] == 0
    assert rec["first_token_at"] is None
    assert (await h.stats())["waiting"] == 0
    assert not busy.done()
    busy.cancel()
    await asyncio.gather(busy, return_exceptions=True)


async def test_zero_latency_profile_serves_200_concurrent_streams(fast: SimHandle) -> None:
    async def one(i: int) -> int:
        s = await sse(
            fast.client, "/v1/chat/completions", chat_body(f"p{i}", stream=True, max_tokens=16)
        )
        assert s.done
        return sum(1 for e in s.events if "content" in e["choices"][0]["delta"]) - 1

    # (How fast is a benchmark's question, not this test's.)
    counts = await asyncio.gather(*(one(i) for i in range(200)))
    assert counts == [16] * 200
    stats = await fast.stats()
    assert stats["finished"] == 200
    assert stats["kv_blocks_used"] == 0


async def test_n_choices_share_each_step(start_sim: StartSim) -> None:
    # n = 3 is three sequences decoding side by side: one step per round of tokens,
    # each a little dearer than a single sequence's (three rows in the batch).
    h = await start_sim(profile="h100-8b", clock=VirtualClock())
    rid = uuid.uuid4().hex
    body = {"model": "sim-8b", "prompt": "Once upon a time", "n": 3, "max_tokens": 8,
            "ignore_eos": True}  # fmt: skip
    r = await h.client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == 24
    assert h.sim.engine.steps == 8  # the prefill emits the first round, then 7 decodes
    rec = await h.record(rid)
    p = h.sim.profile
    one = p.step_time(1, 1, 20)
    assert rec["tpot_s"] == pytest.approx(p.step_time(3, 3, 3 * 20), rel=0.1)
    assert rec["tpot_s"] < 1.2 * one

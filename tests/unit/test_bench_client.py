"""The bench client's stream parsing and outcomes (in-memory servers), its pool of
small httpx clients, and open-loop sending against a slow in-process server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from jetserve.bench.client import ClientPool, stream_one
from jetserve.bench.loadgen import Job, run_job
from jetserve.bench.targets import Target
from jetserve.bench.timeline import Timeline
from jetserve.bench.workload import RequestSpec, WorkloadSpec, build_schedule

REQ = RequestSpec(index=0, at=0.0, cls="interactive", input_tokens=8, output_tokens=3)


def sse(*events: object, done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chat(
    content: str | None = None, *, role: str | None = None, finish: str | None = None
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 8,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 4},
    },
}


async def run_one(
    handler: Callable[[httpx.Request], Any], req: RequestSpec = REQ, deadline_s: float = 5.0
) -> Timeline:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        now = time.perf_counter()
        return await stream_one(
            c, "http://t/v1/chat/completions", {}, b"{}", req, t0=now, deadline=now + deadline_s
        )


async def test_a_vllm_style_stream() -> None:
    body = sse(
        chat("", role="assistant"), chat(" a"), chat(" b"), chat(" c", finish="length"), USAGE
    )
    t = await run_one(lambda r: httpx.Response(200, content=body))
    assert (t.outcome, t.status, t.error) == ("ok", 200, "")
    assert len(t.chunks) == 3  # the empty role chunk is not a token
    assert (t.output_tokens, t.prompt_tokens, t.cached_tokens) == (3, 8, 4)
    assert t.ttft == t.chunks[0]
    assert t.e2e is not None
    assert t.e2e >= t.chunks[-1]


async def test_a_litellm_style_stream_without_done() -> None:
    # LiteLLM's usage chunk has a choice with an empty delta, and may end without [DONE].
    usage = {"choices": [{"index": 0, "delta": {}}], "usage": {"completion_tokens": 2}}
    body = sse(chat(" a"), chat(" b"), chat(None, finish="stop"), usage, done=False)
    t = await run_one(lambda r: httpx.Response(200, content=body))
    assert t.outcome == "ok"
    assert len(t.chunks) == 2
    assert t.output_tokens == 2


async def test_completions_text_chunks() -> None:
    body = sse(
        {"choices": [{"text": " x"}]}, {"choices": [{"text": " y", "finish_reason": "stop"}]}
    )
    t = await run_one(lambda r: httpx.Response(200, content=body))
    assert t.outcome == "ok"
    assert len(t.chunks) == 2
    assert t.output_tokens is None


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(429, "rejected"), (503, "rejected"), (504, "timeout"), (400, "error"), (502, "error")],
)
async def test_statuses(status: int, outcome: str) -> None:
    err = {"error": {"message": "m", "type": "t", "code": "queue_full"}}
    t = await run_one(lambda r: httpx.Response(status, json=err))
    assert (t.outcome, t.status, t.error) == (outcome, status, "queue_full")
    assert t.ttft is None
    assert t.e2e is None


async def test_error_event_mid_stream() -> None:
    body = sse(chat(" a"), {"error": {"code": "stream_interrupted", "message": "gone"}}, done=False)
    t = await run_one(lambda r: httpx.Response(200, content=body))
    assert (t.outcome, t.error, len(t.chunks)) == ("error", "stream_interrupted", 1)


async def test_a_stream_that_stops_early_is_an_error() -> None:
    t = await run_one(lambda r: httpx.Response(200, content=sse(chat(" a"), done=False)))
    assert (t.outcome, t.error) == ("error", "stream ended early")
    t = await run_one(lambda r: httpx.Response(200, content=sse(USAGE)))
    assert (t.outcome, t.error) == ("error", "no output")


async def test_transport_failure() -> None:
    def refuse(r: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    t = await run_one(refuse)
    assert (t.outcome, t.status, t.error) == ("error", 0, "ConnectError")


def slow_stream(gap: float, n: int) -> Callable[[httpx.Request], httpx.Response]:
    async def tokens() -> AsyncIterator[bytes]:
        for _ in range(n):
            await asyncio.sleep(gap)
            yield sse(chat(" t"), done=False)
        yield sse(USAGE)

    return lambda r: httpx.Response(200, content=tokens())


async def test_cancel_after_and_deadline() -> None:
    cancel = RequestSpec(index=1, at=0, cls="x", input_tokens=1, output_tokens=9, cancel_after=0.12)
    t = await run_one(slow_stream(0.05, 10), cancel)
    assert t.outcome == "cancelled"
    assert 1 <= len(t.chunks) <= 3
    t = await run_one(slow_stream(0.05, 10), REQ, deadline_s=0.12)
    assert (t.outcome, t.error) == ("timeout", "client deadline")


async def test_pool_grows_small_clients_and_caps() -> None:
    pool = ClientPool(conns=2, max_clients=3)
    try:
        slots = [pool.acquire() for _ in range(6)]
        assert slots == [0, 0, 1, 1, 2, 2]
        assert pool.size == 3
        pool.release(1)
        assert pool.acquire() == 1  # a free slot first
        assert pool.acquire() in (0, 1, 2)  # full: least busy, no growth
        assert pool.size == 3
    finally:
        await pool.aclose()


async def test_open_loop_keeps_its_schedule_when_the_server_is_slow() -> None:
    """The server answers nothing until all 40 requests have arrived: a closed
    loop (waiting for answers before sending more) would never finish, so all 40
    going out while none is answered is the open loop keeping its schedule. (A
    wall-clock bound on the lag, its old check, failed when a loaded box held
    the event loop for 0.7 s.)"""
    arrived = 0
    all_in = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        nonlocal arrived
        arrived += 1
        if arrived == 40:
            all_in.set()
        await all_in.wait()
        return httpx.Response(200, content=sse(chat(" a"), chat(" b", finish="stop"), USAGE))

    schedule = build_schedule(WorkloadSpec(seed=3), 100.0, count=40)
    job = Job(
        target=Target(name="slow", url="http://slow/v1"),
        requests=schedule,
        model="m",
        salt="s",
        warmup=0,
        lead=0.05,
        conns_per_client=4,
    )
    result = await asyncio.wait_for(run_job(job, transport=httpx.MockTransport(slow)), 60)
    tls = result.timelines
    assert len(tls) == 40
    assert all(t.outcome == "ok" for t in tls)
    assert max(t.sent for t in tls) < min(t.end for t in tls)
    assert result.clients >= 10  # 40 in flight at 4 connections each

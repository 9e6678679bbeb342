"""The failure rules of the served path, with real processes being killed."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from jetserve.fleet import Fleet
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = pytest.mark.connected

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Stream me a long story."}
]
CHAT = {"model": "sim-8b", "messages": MESSAGES}


def auth(fleet: Fleet, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.api_key}", **extra}


async def sim_record(fleet: Fleet, request_id: str) -> dict[str, object]:
    async with httpx.AsyncClient() as c:
        r = await c.get(f"{fleet.sim_url}/sim/requests/{request_id}")
        return dict(r.json()) if r.status_code == 200 else {}


async def sim_stats(fleet: Fleet) -> dict[str, int]:
    async with httpx.AsyncClient() as c:
        return dict((await c.get(f"{fleet.sim_url}/sim/stats")).json())


@contextlib.asynccontextmanager
async def chat_stream(
    fleet: Fleet, body: dict[str, object], fault: str, http_timeout_s: float = 30
) -> AsyncIterator[httpx.Response]:
    """A streamed chat completion through the fleet with a simulator fault, opened (200)."""
    async with (
        httpx.AsyncClient(timeout=http_timeout_s) as c,
        c.stream(
            "POST",
            f"{fleet.base_url}/v1/chat/completions",
            json=body,
            headers=auth(fleet, **{"X-Sim-Fault": fault}),
        ) as r,
    ):
        assert r.status_code == 200
        yield r


async def error_after_first_token(
    r: httpx.Response, on_first: Callable[[], None]
) -> dict[str, Any] | None:
    """Read a chat stream: ``on_first()`` at its first content token, then the
    error event that ends it (None: it ended without one)."""
    first = True
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        payload = msgspec.json.decode(line[6:])
        if "error" in payload:
            error: dict[str, Any] = payload["error"]
            return error
        if first and payload["choices"] and payload["choices"][0]["delta"].get("content"):
            first = False
            on_first()
    return None


async def engine_round_trip(fleet: Fleet) -> None:
    """One short request run to its end on the simulator itself: every engine
    step in flight before it has emitted by the time it returns."""
    body = {"model": "sim-8b", "messages": MESSAGES, "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{fleet.sim_url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


async def test_client_disconnect_stops_engine(fleet: Fleet) -> None:
    """A client that hangs up mid-stream aborts the engine's sequence: the
    simulator records it aborted (not run on to max_tokens), and it generates
    nothing more once aborted."""
    body = {**CHAT, "stream": True, "max_tokens": 2000}
    async with chat_stream(fleet, body, "slow:20", http_timeout_s=10) as r:
        request_id = r.headers["x-request-id"]
        lines = r.aiter_lines()
        seen = 0
        async for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
                if seen >= 5:
                    break
    # The response context is closed: the connection is gone.
    rec: dict[str, object] = {}

    async def aborted() -> bool:
        nonlocal rec
        rec = await sim_record(fleet, request_id)
        return rec.get("status") == "aborted"

    await until(aborted, "the engine aborting the hung-up stream")
    assert rec["finish_reason"] == "abort", rec
    tokens = int(rec["generated_tokens"])  # type: ignore[call-overload]
    assert 0 < tokens < 2000, rec
    # Steps run after the abort (another request's) add nothing to it.
    await engine_round_trip(fleet)
    assert (await sim_record(fleet, request_id))["generated_tokens"] == tokens


async def test_worker_killed_before_first_token_is_redelivered(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1)
    c = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key=fleet.api_key, max_retries=0)
    call = asyncio.create_task(
        c.chat.completions.create(
            model="sim-8b",
            messages=MESSAGES,
            max_tokens=16,
            extra_headers={"X-Sim-Fault": "stall:1500"},
        )
    )

    async def engine_busy() -> bool:
        return (await sim_stats(fleet)).get("records", 0) >= 1  # the engine has it

    await until(engine_busy, "the engine holding the request")
    fleet.workers[0].kill()
    await asyncio.to_thread(fleet.start_worker)
    resp = await asyncio.wait_for(call, 30)
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    stats = await sim_stats(fleet)
    assert stats["started"] >= 2  # the engine saw the redelivery
    await c.close()


async def test_worker_killed_after_first_token_interrupts_stream(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1)
    body = {**CHAT, "stream": True, "max_tokens": 100}
    async with chat_stream(fleet, body, "stall") as r:
        killed: list[bool] = []

        def kill() -> None:
            fleet.workers[0].signal(signal.SIGKILL)
            killed.append(True)

        error = await error_after_first_token(r, kill)
    # The error event ending the stream is the outcome; the client's read
    # timeout only stops a hang.
    assert killed
    assert error is not None
    assert error["code"] == "stream_interrupted"


async def test_expired_deadline_times_out_and_engine_is_never_called(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0)
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=CHAT,
            headers=auth(fleet, **{"X-Jetserve-Timeout": "0.5"}),
        )
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "deadline_exceeded"
    await asyncio.to_thread(fleet.start_worker)  # it finds the expired request in the queue
    nc = await connect(fleet.nats_url, "test", fleet.bus_auth())
    js = nc.jetstream()

    async def queue_empty() -> bool:
        info = await js.consumer_info(DEFAULT_TOPOLOGY.stream, "workers-interactive")
        return (info.num_pending or 0) + (info.num_ack_pending or 0) == 0

    await until(queue_empty, "the worker dropping the expired request")
    await nc.close()
    assert (await sim_stats(fleet))["started"] == 0


async def test_200_concurrent_streams_through_two_workers(fleet: Fleet) -> None:
    n = 200
    bodies = [
        {
            "model": "sim-8b",
            "messages": [{"role": "user", "content": f"request number {i}"}],
            "max_tokens": 32,
        }
        for i in range(n)
    ]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as c:
        refs = await asyncio.gather(
            *(c.post(f"{fleet.sim_url}/v1/chat/completions", json=b) for b in bodies)
        )
        expected = [r.json()["choices"][0]["message"]["content"] for r in refs]
        before = await sim_stats(fleet)

        async def one(body: dict[str, object]) -> tuple[str, int]:
            text: list[str] = []
            dones = 0
            async with c.stream(
                "POST",
                f"{fleet.base_url}/v1/chat/completions",
                json={**body, "stream": True},
                headers=auth(fleet),
            ) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        dones += 1
                    elif line.startswith("data: "):
                        chunk = msgspec.json.decode(line[6:])
                        assert "error" not in chunk, chunk
                        for ch in chunk["choices"]:
                            text.append(ch["delta"].get("content") or "")
            return "".join(text), dones

        results = await asyncio.gather(*(one(b) for b in bodies))
    assert [t for t, _ in results] == expected
    assert all(d == 1 for _, d in results)
    after = await sim_stats(fleet)
    assert after["finished"] - before["finished"] == n  # each ran exactly once on the engine


async def test_cancel_before_pickup_removes_the_request(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0)
    async with httpx.AsyncClient(timeout=10) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                f"{fleet.base_url}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers=auth(fleet),
                timeout=httpx.Timeout(10, read=0.5),  # the client gives up while queued
            )
    nc = await connect(fleet.nats_url, "test", fleet.bus_auth())
    js = nc.jetstream()

    async def queue_empty() -> bool:
        info = await js.consumer_info(DEFAULT_TOPOLOGY.stream, "workers-interactive")
        return (info.num_pending or 0) + (info.num_ack_pending or 0) == 0

    await until(queue_empty, "the cancelled request leaving the queue")  # not left for a worker
    await nc.close()
    await asyncio.to_thread(fleet.start_worker)
    # A request queued after it is served: had the cancelled one been left
    # in the queue, the worker would have pulled it first.
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={**CHAT, "max_tokens": 4},
            headers=auth(fleet),
        )
    assert r.status_code == 200, r.text
    assert (await sim_stats(fleet))["started"] == 1


async def test_a_coalesced_stream_whose_worker_goes_silent_ends_for_every_member(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Two identical T=0 streams share one execution (``--coalesce``); its worker
    goes quiet mid-stream (SIGSTOP). Both clients get ``stream_interrupted``:
    the group's pump used to feed its members a heartbeat of its own every third
    of a heartbeat timeout whatever the worker did, and they waited forever (a
    started stream has no deadline)."""
    fleet = make_fleet(workers=1, gateway_args=["--heartbeat-timeout", "1", "--coalesce"])
    body = {**CHAT, "stream": True, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    worker = fleet.workers[0]
    joined = asyncio.Event()
    stopped: list[bool] = []

    def freeze() -> None:
        worker.signal(signal.SIGSTOP)
        stopped.append(True)

    async def coalesced() -> bool:
        async with httpx.AsyncClient() as c:
            text = (await c.get(fleet.gateway_metrics_urls[0])).text
        return metric_sum(text, "jetserve_gateway_coalesced_total") >= 1

    async def member(on_first: Callable[[], None]) -> dict[str, Any] | None:
        async with chat_stream(fleet, body, "slow:20") as r:
            return await error_after_first_token(r, on_first)

    async def second() -> dict[str, Any] | None:
        await joined.wait()

        async def join_then_freeze() -> None:
            await until(coalesced, "the second stream joining the first's execution")
            freeze()

        task = asyncio.create_task(join_then_freeze())
        try:
            return await member(lambda: None)
        finally:
            await task

    try:
        errors = await asyncio.gather(member(joined.set), second())
    finally:
        worker.signal(signal.SIGCONT)
    assert stopped
    assert [e and e["code"] for e in errors] == ["stream_interrupted"] * 2, errors


def test_embeddings_over_the_bus_message_size_are_a_400_not_a_lost_answer(
    fleet: Fleet,
) -> None:
    """700 inputs fit the request (and the bus), but their 384-dim vectors do not
    fit one answer frame (over 1 MiB). The worker checks before it sends or acks:
    a 400 ``response_too_large``. It used to ack, fail to publish, and leave the
    client waiting for an answer that never came (with the lost-answer watch, a
    502 ``answer_lost`` two heartbeat timeouts later: the client's retry fails alike)."""
    body = {"model": "sim-embed", "input": [f"x{i}" for i in range(700)]}
    r = httpx.post(f"{fleet.base_url}/v1/embeddings", json=body, headers=auth(fleet), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "response_too_large"
    small = {"model": "sim-embed", "input": [f"x{i}" for i in range(100)]}
    r = httpx.post(f"{fleet.base_url}/v1/embeddings", json=small, headers=auth(fleet), timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 100


def test_oversized_request_is_413(fleet: Fleet) -> None:
    # Over the bus's message size (1 MiB), under the body cap (4 MiB).
    body = {"model": "sim-embed", "input": "x" * 1_500_000}
    r = httpx.post(f"{fleet.base_url}/v1/embeddings", json=body, headers=auth(fleet))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # A chat prompt that size cannot fit the model's context either: that refusal
    # comes first, before any hold.
    chat = {"model": "sim-8b", "messages": [{"role": "user", "content": "x" * 1_500_000}]}
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=chat, headers=auth(fleet))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_a_silent_stream_given_up_on_is_cancelled_in_the_engine(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A worker that goes quiet mid-stream (here frozen by SIGSTOP, as a worker
    starved of CPU or cut off from the bus) ends the client's stream with
    ``stream_interrupted``, and the gateway cancels it: once the worker runs
    again it stops the engine, rather than generate for nobody to the end."""
    fleet = make_fleet(workers=1, gateway_args=["--heartbeat-timeout", "1"])
    body = {**CHAT, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    worker = fleet.workers[0]
    stopped: list[bool] = []

    def freeze() -> None:
        worker.signal(signal.SIGSTOP)
        stopped.append(True)

    async with chat_stream(fleet, body, "slow:20") as r:  # 40 s uncancelled
        request_id = r.headers["x-request-id"]
        try:
            error = await error_after_first_token(r, freeze)
        finally:
            worker.signal(signal.SIGCONT)
    assert stopped
    assert error is not None
    assert error["code"] == "stream_interrupted", error
    rec: dict[str, object] = {}

    async def ended() -> bool:
        nonlocal rec
        rec = await sim_record(fleet, request_id)
        return rec.get("status") in ("aborted", "finished")

    await until(ended, "the engine ending the given-up stream", 60.0)
    assert rec["status"] == "aborted", rec  # not run on to max_tokens
    assert int(rec["generated_tokens"]) < 2000  # type: ignore[call-overload]

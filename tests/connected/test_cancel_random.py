"""A client that hangs up stops the engine, wherever the request is: queued,
pulled but not yet started, prefilling, or streaming. Every hop is real
(gateway, NATS, worker, the simulator's HTTP server); only the moments are
drawn, from a seeded generator, the same as the real-vLLM tier's
(tests/vllm/test_vllm_cancel.py)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet
from streams.auth import Role
from streams.definitions import DEFAULT_TOPOLOGY
from streams.inference.client import InferenceClient
from streams.subjects import RequestClass, reply_subject, request_subject
from streams.wire import ErrorFrame, InferenceRequest, decode_frame
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(240)]

STREAMS = 48
MAX_TOKENS = 400  # at 5 ms a token no stream can finish before its client hangs up
HANG_UP_S = (0.0, 0.6)  # a cancel lands anywhere from the queue to mid-stream


async def hang_up_at(
    c: httpx.AsyncClient, fleet: Fleet, i: int, after_s: float
) -> tuple[str | None, int]:
    """One streaming request the client abandons ``after_s`` seconds after
    sending it: (request id if the response started, tokens read)."""
    body = {
        "model": "sim-8b",
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"A long story, number {i}."}],
    }
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:5"}
    rid, tokens = None, 0
    try:
        async with asyncio.timeout(after_s):
            async with c.stream(
                "POST", f"{fleet.base_url}/v1/chat/completions", json=body, headers=headers
            ) as r:
                rid = r.headers.get("x-request-id")
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        tokens += 1
    except TimeoutError:
        pass
    return rid, tokens


async def sim_stats(fleet: Fleet) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        return dict((await c.get(f"{fleet.sim_url}/sim/stats")).json())


async def test_cancels_at_random_moments_stop_every_stream(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=2)
    rng = random.Random(13)
    moments = [rng.uniform(*HANG_UP_S) for _ in range(STREAMS)]
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as c:
        runs = []
        for i, after in enumerate(moments):
            runs.append(asyncio.create_task(hang_up_at(c, fleet, i, after)))
            await asyncio.sleep(rng.uniform(0.0, 0.04))  # arrivals overlap: queueing too
        results = await asyncio.gather(*runs)

    async def engine_idle() -> bool:
        stats = await sim_stats(fleet)
        return bool(stats["running"] == 0 and stats["waiting"] == 0)

    # A stream that kept going would run its 400 tokens (2 s) and finish.
    await until(engine_idle, "the engine has nothing running", 30.0)
    stats = await sim_stats(fleet)
    print(
        f"\n{STREAMS} streams hung up at random: {stats['started']} reached the engine, "
        f"{stats['aborted']} aborted, {stats['finished']} finished; "
        f"{stats['aborted_tokens']} tokens generated for them"
    )
    assert stats["started"] > 0, stats  # some reached the engine: the checks bite
    assert stats["finished"] == 0, stats
    assert stats["aborted"] == stats["started"], stats
    async with httpx.AsyncClient() as c:
        for rid, tokens in results:
            if rid is None:
                continue  # hung up before the response started (queued, or prefilling)
            rec = (await c.get(f"{fleet.sim_url}/sim/requests/{rid}")).json()
            assert rec["status"] == "aborted", rec
            # Stopped promptly: a few tokens past what was read, far short of
            # MAX_TOKENS.
            assert rec["generated_tokens"] < tokens + 200, (rec, tokens)


async def test_a_cancel_sent_before_any_worker_listens_is_honoured(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The cancel is published while the request waits in the queue with no
    worker running, and the queued message is left there (as a caller that does
    not know its sequence leaves it): the worker that later takes it reads the
    durable mark, never calls the engine, and says why on the reply subject."""
    fleet = make_fleet(workers=0)
    nc = await fleet.connect(Role.GATEWAY)
    try:
        js = nc.jetstream()
        client = InferenceClient(nc, js, DEFAULT_TOPOLOGY)
        rid = "cancelled-before-ready"
        reply = reply_subject(fleet.spec.tenant, "testgw", rid)
        frames: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_frame(msg: Any) -> None:
            await frames.put(msg.data)

        await nc.subscribe(reply, cb=on_frame)
        now = time.time()
        req = InferenceRequest(
            id=rid,
            op="chat",
            cls=RequestClass.INTERACTIVE.value,
            model="sim-8b",
            body={"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}]},
            reply=reply,
            deadline=now + 60,
            tenant=fleet.spec.tenant,
            created=now,
            max_tokens=16,
        )
        await client.publish(request_subject(RequestClass.INTERACTIVE), req)
        await client.cancel(rid, "client_disconnected")  # no sequence: the message stays
        await asyncio.to_thread(fleet.start_worker)
        frame = decode_frame(await asyncio.wait_for(frames.get(), 30))
        assert isinstance(frame, ErrorFrame), frame
        assert frame.code == "cancelled"
        async with httpx.AsyncClient() as c:
            r = await c.get(f"{fleet.sim_url}/sim/requests/{rid}")
        assert r.status_code == 404  # the engine never saw it
        info = await js.stream_info(DEFAULT_TOPOLOGY.stream)
        assert info.state.messages == 0  # terminated, not left to come back
    finally:
        await nc.close()

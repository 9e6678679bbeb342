"""Keep-alives while queued, and a worker draining on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import NamedTuple

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet
from tests.scrape import fleet_sum
from tests.waits import until

pytestmark = pytest.mark.connected

CHAT = {"model": "sim-8b", "messages": [{"role": "user", "content": "keep me company"}]}


async def test_sse_keepalive_comments_while_waiting_for_first_token(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1, gateway_args=["--keepalive", "0.2", "--commit-after", "0.2"])
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "stall:1200"}
    lines: list[str] = []
    async with (
        httpx.AsyncClient(timeout=10) as c,
        c.stream(
            "POST",
            f"{fleet.base_url}/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 5},
            headers=headers,
        ) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert lines[:first_data].count(": keep-alive") >= 2
    assert lines[-1] == "data: [DONE]"


async def test_sigterm_drains_in_flight_stream(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=1)
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:30"}
    text: list[str] = []
    finish = None
    async with (
        httpx.AsyncClient(timeout=20) as c,
        c.stream(
            "POST",
            f"{fleet.base_url}/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 40},
            headers=headers,
        ) as r,
    ):
        signalled = False
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = msgspec.json.decode(line[6:])
            assert "error" not in chunk, chunk
            for ch in chunk["choices"]:
                text.append(ch["delta"].get("content") or "")
                finish = ch["finish_reason"] or finish
            if not signalled and "".join(text):
                fleet.workers[0].signal(signal.SIGTERM)  # mid-stream
                signalled = True
    assert signalled
    assert finish in ("stop", "length")
    assert "".join(text)
    # The worker finished the stream, then exited by itself.
    assert await asyncio.to_thread(fleet.workers[0].proc.wait, 10) == 0


async def test_gateway_sigterm_finishes_open_streams_then_exits(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1)
    gw = fleet.gateway
    assert gw is not None
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:30"}
    text: list[str] = []
    done = False
    async with (
        httpx.AsyncClient(timeout=20) as c,
        c.stream(
            "POST",
            f"{fleet.base_url}/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 40},
            headers=headers,
        ) as r,
    ):
        signalled = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = msgspec.json.decode(line[6:])
                assert "error" not in chunk, chunk
                text.extend(ch["delta"].get("content") or "" for ch in chunk["choices"])
                if not signalled and "".join(text):
                    gw.signal(signal.SIGTERM)  # stop accepting; finish what is open
                    signalled = True
                    await until(lambda: _refused(fleet), "the gateway refusing connections")
    assert done
    assert "".join(text)
    assert await asyncio.to_thread(gw.proc.wait, 10) == 0


async def _refused(fleet: Fleet) -> bool:
    """A new connection to the gateway is refused (a fresh client each time: a
    pooled keep-alive connection is not a new one)."""
    async with httpx.AsyncClient(timeout=10) as probe:
        try:
            await probe.get(f"{fleet.base_url}/healthz")
        except httpx.ConnectError:
            return True
    return False


class BlockWait(NamedTuple):
    streaming: asyncio.Task[str | None]  # the long stream: its finish reason
    waiter: asyncio.Task[httpx.Response]  # the request waiting for its blocks


async def a_request_waiting_for_blocks(
    c: httpx.AsyncClient, fleet: Fleet, slow_ms: int
) -> BlockWait:
    """On a worker of 100 blocks of 16 tokens (90 % of them its budget), a stream
    of 800 tokens (``slow_ms`` each) holds the blocks a second request of 800
    needs: returned once that one waits for them."""
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    body = {**CHAT, "max_tokens": 800, "ignore_eos": True}
    metrics = [f"http://127.0.0.1:{port}/metrics" for port in fleet.worker_metrics_ports]
    first_token = asyncio.Event()

    async def long_stream() -> str | None:
        finish = None
        async with c.stream(
            "POST", f"{fleet.base_url}/v1/chat/completions",
            json={**body, "stream": True}, headers={**auth, "X-Sim-Fault": f"slow:{slow_ms}"},
        ) as r:  # fmt: skip
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = msgspec.json.decode(line[6:])
                    assert "error" not in chunk, chunk
                    first_token.set()
                    for ch in chunk["choices"]:
                        finish = ch["finish_reason"] or finish
        return finish

    streaming = asyncio.create_task(long_stream())
    await first_token.wait()
    waiter = asyncio.create_task(
        c.post(f"{fleet.base_url}/v1/chat/completions", json=body, headers=auth)
    )

    async def waiting() -> float:
        return await fleet_sum(metrics, "jetserve_worker_block_waits_total")

    await until(waiting, "the second request waiting for KV blocks")
    return BlockWait(streaming, waiter)


async def test_a_stopping_worker_hands_back_a_request_waiting_for_kv_blocks(
    make_fleet: Callable[..., Fleet],
) -> None:
    # One request of 800 tokens fits, a second waits for it. Stopped meanwhile,
    # the worker used to keep the waiter through its drain and serve it after the
    # first had ended (or let it go after the server's ack wait, without a nak).
    fleet = make_fleet(workers=1, sim_args=["--num-gpu-blocks", "100"])
    metrics = [f"http://127.0.0.1:{port}/metrics" for port in fleet.worker_metrics_ports]
    async with httpx.AsyncClient(timeout=120) as c:
        streaming, waiter = await a_request_waiting_for_blocks(c, fleet, 25)  # 20 s of tokens
        fleet.start_worker(wait=False)
        second = [f"http://127.0.0.1:{fleet.worker_metrics_ports[1]}/metrics"]

        async def ready() -> bool:
            # (Not "pulling": the first, its request waiting, pulls no more.)
            try:
                return (await c.get(second[0].replace("/metrics", "/readyz"))).is_success
            except httpx.TransportError:
                return False

        await until(ready, "a second worker ready")
        fleet.workers[0].signal(signal.SIGTERM)
        r = await waiter
        assert r.status_code == 200, r.text
        # Served by the new worker, while the stopping one still drains the first.
        assert await fleet_sum(second, "jetserve_worker_requests_total", outcome="ok") == 1
        handed = await fleet_sum(metrics, "jetserve_worker_redeliveries_total", reason="shutdown")
        assert handed == 1
        assert await streaming == "length"
    assert await asyncio.to_thread(fleet.workers[0].proc.wait, 30) == 0


async def test_a_request_cancelled_while_waiting_for_kv_blocks_gives_its_place_up(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A long stream holds most of the KV blocks; a big request waits for them at
    the head of the worker's block queue. Its client leaves: the worker kept it
    there until the long stream ended (nothing behind it got blocks, and the
    worker pulled nothing meanwhile), and only then ended it. It gives its place
    up at once now, ended while the long stream still runs, engine untouched."""
    fleet = make_fleet(workers=1, sim_args=["--num-gpu-blocks", "100"])
    metrics = [f"http://127.0.0.1:{port}/metrics" for port in fleet.worker_metrics_ports]
    async with httpx.AsyncClient(timeout=120) as c:
        streaming, big = await a_request_waiting_for_blocks(c, fleet, 50)  # 40 s of tokens
        big.cancel()  # its client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await big

        async def ended_at_the_worker() -> float:
            return await fleet_sum(metrics, "jetserve_worker_requests_total", outcome="cancelled")

        await until(ended_at_the_worker, "the worker ending the cancelled request")
        assert not streaming.done()  # while the long stream still holds its blocks
        engine = (await c.get(f"{fleet.sim_url}/sim/stats")).json()
        assert engine["requests"] == 1  # the long stream's only
        streaming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await streaming

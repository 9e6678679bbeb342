"""A slow client never grows gateway memory without bound.

500 clients open streams and stop reading (tiny receive windows); 20 normal
clients stream alongside. The gateway's RSS must stay flat while they hang on,
the normal clients must be unaffected, and a client that stays too slow for too
many frames gets its stream ended (``client_too_slow``) with the engine stopped.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.faults, pytest.mark.timeout(180)]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def stuck_client(
    port: int, key: str, body: dict[str, object], fault: str = "slow:20"
) -> asyncio.StreamWriter:
    """Send a streaming request, then never read: a 4 KiB receive window fills."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    payload = msgspec.json.encode(body)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\nX-Sim-Fault: " + fault.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )
    await writer.drain()
    return writer


async def sim_stats(fleet: Fleet) -> dict[str, int]:
    async with httpx.AsyncClient() as c:
        return dict((await c.get(f"{fleet.sim_url}/sim/stats")).json())


async def test_500_stuck_clients_keep_gateway_memory_flat(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(
        workers=2,
        worker_args=["--max-inflight", "300"],
        sim_args=["--max-num-seqs", "600"],
        gateway_args=["--max-buffered-frames", "64"],
    )
    assert fleet.gateway is not None
    pid = fleet.gateway.proc.pid
    base = rss_mb(pid)
    body = {
        "model": "sim-8b",
        "stream": True,
        "max_tokens": 400,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "fill my buffers"}],
    }
    stuck = [await stuck_client(fleet.gateway_port, fleet.api_key, body) for _ in range(500)]
    samples: list[tuple[float, float]] = []
    normal_ok = 0
    start = time.monotonic()

    async def sample() -> None:
        while time.monotonic() - start < 20:
            samples.append((time.monotonic() - start, rss_mb(pid)))
            await asyncio.sleep(0.5)

    async def normal(i: int) -> bool:
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(
                f"{fleet.base_url}/v1/chat/completions",
                json={
                    "model": "sim-8b",
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": f"normal {i}"}],
                },
                headers={"Authorization": f"Bearer {fleet.api_key}"},
            )
            return r.status_code == 200

    sampler = asyncio.create_task(sample())
    results = await asyncio.gather(*(normal(i) for i in range(20)))
    normal_ok = sum(results)
    await sampler
    for _ in range(400):  # every stuck stream still ends (into kernel buffers or cut off)
        stats = await sim_stats(fleet)
        if stats["finished"] + stats["aborted"] >= 520:
            break
        await asyncio.sleep(0.1)
    for w in stuck:
        w.close()
    peak = max(m for _, m in samples)
    late = [m for t, m in samples if t >= 10]
    print(
        f"\nbackpressure: gateway RSS base {base:.0f} MB, peak {peak:.0f} MB, "
        f"last 10 s {min(late):.0f}-{max(late):.0f} MB; engine finished "
        f"{stats['finished']}, aborted {stats['aborted']}; normal clients ok {normal_ok}/20"
    )
    assert normal_ok == 20
    assert max(late) - min(late) < 40  # flat while 500 clients hang on
    assert peak - base < 300  # bounded: at most 64 frames per request, not whole streams
    assert stats["finished"] + stats["aborted"] >= 520  # no stream was left running


async def test_a_client_too_slow_for_too_long_is_ended_and_the_engine_stopped(
    make_fleet: Callable[..., Fleet],
) -> None:
    # The engine paced (3 ms a token: 18 s for the whole answer) and the kernel's
    # share bounded (--client-send-buffer): the client fills what it may park
    # (some 200 KB, ~1000 tokens) in a few seconds, then the gateway's 64 frames,
    # and the engine must be stopped long before its answer could end. With the
    # simulator unpaced and the kernel autotuning (up to 4 MiB), it was a CPU race
    # the engine won on a loaded box: all 4 answers ran to their end.
    fleet = make_fleet(
        workers=1,
        gateway_args=["--max-buffered-frames", "64", "--client-send-buffer", "16384"],
        log_level="info",  # a failure's output shows each cancel's path
    )
    body = {
        "model": "sim-8b",
        "stream": True,
        "max_tokens": 6000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "far more than any buffer"}],
    }
    stuck = [
        await stuck_client(fleet.gateway_port, fleet.api_key, body, fault="slow:3")
        for _ in range(4)
    ]
    try:
        ended: dict[str, int] = {}

        async def all_ended() -> bool:
            ended.update(await sim_stats(fleet))
            return ended["aborted"] + ended["finished"] >= 4

        await until(all_ended, "the 4 stuck streams ended, aborted or finished", 60.0)
        assert ended["aborted"] == 4, ended  # the engine stopped each of them
        async with httpx.AsyncClient() as c:
            text = (await c.get(fleet.gateway_metrics_urls[0])).text
        assert 'outcome="client_too_slow"' in text
    finally:
        for w in stuck:
            w.close()

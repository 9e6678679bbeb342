"""Client hang-ups at random moments, through a whole fleet to a real vLLM: no
stream may keep generating after its client closed.

The same draw of moments as the simulator tier (tests/connected/test_cancel_random.py),
scaled to this engine: vLLM CPU with a tiny model, ``max_num_seqs`` 4, so the
streams go in waves of 4 and a hang-up can land while the request is queued in
jetserve, queued in vLLM, prefilling or streaming. A stream that vLLM runs to its
``max_tokens`` ends ``length`` in ``vllm:request_success_total``; an aborted one is
not counted there (docs/vllm.md), which makes that counter the per-stream check.
Opt-in (docs/vllm.md): `bench/peers/vllm.sh test -k cancel`.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from jetserve.fleet import Fleet, FleetSpec
from tests.scrape import metric_sum
from tests.vllm.vllmkit import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

STREAMS = int(os.environ.get("JETSERVE_VLLM_CANCELS", "32"))
WAVE = 4  # the server's max_num_seqs
MAX_TOKENS = 512  # EOS ignored: only a hang-up ends a stream early
HANG_UP_S = (0.0, 0.5)


def metric(url: str, name: str, **labels: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=5.0).text, name, **labels)


async def idle(url: str, limit_s: float = 60.0) -> None:
    """Until vLLM runs and queues nothing (a stream left running ends at max_tokens)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        running = await asyncio.to_thread(metric, url, "vllm:num_requests_running")
        waiting = await asyncio.to_thread(metric, url, "vllm:num_requests_waiting")
        if running == 0 and waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"vLLM still busy after {limit_s}s")


async def hang_up_at(c: httpx.AsyncClient, fleet: Fleet, i: int, after_s: float) -> int:
    """One stream, abandoned ``after_s`` seconds after it was sent: the tokens read."""
    body = {
        "model": fleet.spec.model,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Tell story number {i}."}],
    }
    tokens = 0
    try:
        async with asyncio.timeout(after_s):
            async with c.stream(
                "POST",
                f"{fleet.base_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {fleet.api_key}"},
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        tokens += 1
    except TimeoutError:
        pass
    return tokens


async def test_hang_ups_at_random_moments_stop_vllm(vllm_server: VllmServer) -> None:
    url = vllm_server.url
    spec = FleetSpec(workers=1, engine_url=url, model=vllm_server.model)
    rng = random.Random(13)
    moments = [rng.uniform(*HANG_UP_S) for _ in range(STREAMS)]
    with Fleet(spec) as fleet:
        await idle(url)
        ran_out = metric(url, "vllm:request_success_total", finished_reason="length")
        generated = metric(url, "vllm:generation_tokens_total")
        read = 0
        async with httpx.AsyncClient(timeout=60) as c:
            for start in range(0, STREAMS, WAVE):
                wave = []
                for i in range(start, min(start + WAVE, STREAMS)):
                    wave.append(asyncio.create_task(hang_up_at(c, fleet, i, moments[i])))
                    await asyncio.sleep(rng.uniform(0.0, 0.05))
                read += sum(await asyncio.gather(*wave))
                await idle(url)
        await asyncio.sleep(0.5)  # the counters settle
        kept = metric(url, "vllm:request_success_total", finished_reason="length") - ran_out
        extra = metric(url, "vllm:generation_tokens_total") - generated - read
    print(
        f"\nvllm tier: {STREAMS} streams hung up at random moments: {kept:.0f} ran on to "
        f"max_tokens ({MAX_TOKENS}); {read} tokens read, {extra:.0f} more generated"
    )
    assert kept == 0

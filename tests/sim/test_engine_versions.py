"""What each adapter reads of its engine's build (``EngineAdapter.version``:
workers advertise it, and route evidence fires ``engine_version_changed`` when
it moves), against the simulator's vLLM, TGI and Triton surfaces."""

from __future__ import annotations

import httpx

from tests.sim.simkit import StartSim
from workers.engines.openai import OpenAIAdapter
from workers.engines.tgi import TGIAdapter
from workers.engines.triton import TritonAdapter


async def test_each_adapter_reads_its_engines_version(start_sim: StartSim) -> None:
    sim = await start_sim(profile="fast", engine_version="0.12.1")
    async with OpenAIAdapter(sim.url) as vllm:
        assert await vllm.version() == "vllm 0.12.1"  # vLLM's GET /version
    async with TGIAdapter(sim.url) as tgi:
        assert await tgi.version() == "tgi 0.12.1"  # TGI's GET /info
    async with TritonAdapter(sim.url, model="sim-8b") as triton:
        assert await triton.version() == "triton 0.12.1"  # KServe v2 GET /v2


async def test_an_engine_that_does_not_say_reads_as_unknown(start_sim: StartSim) -> None:
    sim = await start_sim(profile="fast")
    # A server without the path (an older build, another product) or one that
    # is down: "" (unknown), never an error that stops the worker.
    async with TritonAdapter(sim.url + "/nothing-here", model="sim-8b") as missing:
        assert await missing.version() == ""
    async with httpx.AsyncClient() as c:
        assert (await c.get(sim.url + "/nothing-here/v2")).status_code == 404
    async with OpenAIAdapter("http://127.0.0.1:9") as down:
        assert await down.version() == ""

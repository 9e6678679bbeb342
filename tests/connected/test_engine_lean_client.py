"""OpenAIAdapter's lean path (workers/engines/lean_http.py) against the real
simulator in its own process: the same text, usage and finish reason (and the
same embeddings) as httpx gives, keep-alive reuse, and a cancel mid-stream
reaching the engine as an abort."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from jetserve.services import free_port, wait_port
from streams.vectors import floats
from tests.waits import until
from workers.engines.base import Delta, Done, closing
from workers.engines.openai import OpenAIAdapter
from workers.errors import EngineError

pytestmark = pytest.mark.connected

CHAT = {"model": "sim-8b", "messages": [{"role": "user", "content": "say something"}]}


def _sim(*extra: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "--profile", "fast", "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, 30.0, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    yield from _sim()


@pytest.fixture(scope="module")
def floats_only_url() -> Iterator[str]:
    """An engine that refuses ``encoding_format: base64`` (some OpenAI-compatible ones do)."""
    yield from _sim("--embedding-encodings", "float")


@pytest.fixture
async def adapter(sim_url: str) -> AsyncIterator[OpenAIAdapter]:
    async with OpenAIAdapter(sim_url) as a:
        assert a._lean is not None  # http:// streams take the lean path
        yield a


async def record(sim_url: str, request_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.get(f"{sim_url}/sim/requests/{request_id}")
    rec: dict[str, Any] = r.json() if r.status_code == 200 else {}
    return rec


async def run(adapter: OpenAIAdapter, op: Any, body: dict[str, Any], rid: str) -> tuple[str, Done]:
    events = [e async for e in adapter.generate(op, body, rid, {})]
    done = events[-1]
    assert isinstance(done, Done)
    assert all(isinstance(e, Delta) for e in events[:-1])
    return "".join(e.text for e in events[:-1] if isinstance(e, Delta)), done


@pytest.mark.parametrize(
    ("op", "body"),
    [
        ("chat", {**CHAT, "max_tokens": 12}),
        ("completion", {"model": "sim-8b", "prompt": "once upon a time", "max_tokens": 12}),
    ],
)
async def test_stream_matches_httpx(
    adapter: OpenAIAdapter, sim_url: str, op: str, body: dict[str, Any]
) -> None:
    text, done = await run(adapter, op, body, f"lean-{op}")
    assert text
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens > 0
    assert done.model == "sim-8b"
    assert (await record(sim_url, f"lean-{op}"))["status"] == "finished"
    async with OpenAIAdapter(sim_url, lean_streams=False) as plain:
        assert await run(plain, op, body, f"httpx-{op}") == (text, done)


async def test_sequential_streams_share_one_connection(adapter: OpenAIAdapter) -> None:
    assert adapter._lean is not None
    for i in range(5):
        await run(adapter, "chat", {**CHAT, "max_tokens": 4}, f"seq-{i}")
        # A stream ends at [DONE]; its socket rejoins the pool when the chunked
        # terminator (a separate write) lands, so wait for that, not a sleep.
        await until(lambda: _true(adapter._lean is not None and adapter._lean._idle), "pooled")
    assert adapter._lean.connects == 1


async def test_embeddings_take_the_lean_path_and_match_httpx(
    adapter: OpenAIAdapter, sim_url: str
) -> None:
    lean = adapter._lean
    assert lean is not None
    body = {"model": "sim-embed", "input": ["one text", "and another, longer text"]}
    got = [await adapter.embed(body, f"lean-embed-{i}", {}) for i in range(5)]
    assert lean.connects == 1  # all five on one kept-alive lean socket
    assert (await record(sim_url, "lean-embed-4"))["status"] == "finished"
    async with OpenAIAdapter(sim_url, lean_streams=False) as plain:
        want = await plain.embed(body, "httpx-embed", {})
        assert all(g == want for g in got)
        assert len(want.vectors) == 2
        assert want.usage.prompt_tokens > 0
        # An engine's refusal reads the same on both paths.
        bad = {"model": "no-such-model", "input": "x"}
        with pytest.raises(EngineError) as plain_err:
            await plain.embed(bad, "httpx-bad", {})
    with pytest.raises(EngineError) as lean_err:
        await adapter.embed(bad, "lean-bad", {})
    assert (lean_err.value.code, lean_err.value.status) == (
        plain_err.value.code,
        plain_err.value.status,
    )


async def test_cancel_mid_stream_aborts_in_the_engine(adapter: OpenAIAdapter, sim_url: str) -> None:
    rid = "lean-cancel"
    body = {**CHAT, "max_tokens": 4000}
    got = asyncio.Event()

    async def consume() -> None:
        # 50 ms per token (the simulator's slow fault): still streaming when cancelled.
        events = adapter.generate("chat", body, rid, {"X-Sim-Fault": "slow:50"})
        async with closing(events):
            async for event in events:
                if isinstance(event, Delta) and event.text:
                    got.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got.wait(), 30)
    assert (await record(sim_url, rid))["status"] == "running"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def aborted() -> bool:
        return (await record(sim_url, rid)).get("status") == "aborted"

    await until(aborted, "the simulator to record the abort")
    rec = await record(sim_url, rid)
    assert rec["status"] == "aborted", rec


async def _true(value: object) -> bool:
    return bool(value)


async def test_the_engine_poll_reads_load_and_health_on_one_kept_alive_socket(
    adapter: OpenAIAdapter, sim_url: str
) -> None:
    lean = adapter._lean
    assert lean is not None
    before = lean.connects
    for _ in range(5):
        load = await adapter.load()
        assert load.num_gpu_blocks  # the simulator's vLLM metrics, parsed
        assert await adapter.healthy()
    assert lean.connects - before <= 1  # ten GETs, at most one new connection
    # The same figures httpx reads.
    async with OpenAIAdapter(sim_url, lean_streams=False) as plain:
        assert (await plain.load()).num_gpu_blocks == load.num_gpu_blocks


async def test_the_engine_poll_says_down_when_nothing_listens() -> None:
    async with OpenAIAdapter(f"http://127.0.0.1:{free_port()}") as gone:
        assert not await gone.healthy()
        assert (await gone.load()).num_gpu_blocks is None


async def test_embeddings_come_packed_and_unpack_to_the_engines_floats(
    adapter: OpenAIAdapter, sim_url: str
) -> None:
    body = {"model": "sim-embed", "input": ["one text", "and another, longer text"]}
    got = await adapter.embed(body, "packed-1", {})
    assert all(isinstance(v, bytes) and len(v) == 4 * 384 for v in got.vectors)
    async with httpx.AsyncClient(timeout=10) as c:
        direct = (await c.post(f"{sim_url}/v1/embeddings", json=body)).json()
    assert [floats(v) for v in got.vectors] == [d["embedding"] for d in direct["data"]]


async def test_an_engine_without_base64_is_asked_for_floats(floats_only_url: str) -> None:
    """The adapter asks for floats once the engine refused base64, and from then on."""
    url = floats_only_url
    body = {"model": "sim-embed", "input": ["floats only"]}
    async with httpx.AsyncClient(timeout=10) as c:
        refused = await c.post(f"{url}/v1/embeddings", json={**body, "encoding_format": "base64"})
        assert refused.status_code == 400
        direct = (await c.post(f"{url}/v1/embeddings", json=body)).json()
    async with OpenAIAdapter(url) as a:
        for i in range(2):
            got = await a.embed(body, f"floats-{i}", {})
            assert got.vectors == [direct["data"][0]["embedding"]]
            assert await record(url, f"floats-{i}") != {}  # served, as floats
    # A refusal that is not about the encoding is the caller's.
    async with OpenAIAdapter(url) as a:
        with pytest.raises(EngineError):
            await a.embed({"model": "no-such-model", "input": "x"}, "bad", {})

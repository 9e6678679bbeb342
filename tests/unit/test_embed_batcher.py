"""The embedding micro-batcher against the real simulator (served in-process):
merging, exact per-request usage, limits, failures, deadlines, cancellation."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from sim.app import create_app
from sim.cli import uvicorn_config
from sim.config import SimConfig
from tests.waits import until_true
from workers.engines.openai import OpenAIAdapter
from workers.errors import EngineRejected, EngineUnavailable
from workers.inference.batching import EmbedBatcher, split_inputs, split_total

TEXTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "embeddings are small requests with a large fixed cost per call",
    "one two three four five six seven",
    "jetserve batches them",
    "",
    "tokens, punctuation; and-hyphens!",
]


class Sim:
    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url
        self.client = client

    async def embed_calls(self) -> int:
        r = await self.client.get("/sim/stats")
        r.raise_for_status()
        return int(r.json()["embeddings"])


@asynccontextmanager
async def serve(cfg: SimConfig) -> AsyncIterator[Sim]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(create_app(cfg), "127.0.0.1", port))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.002)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield Sim(f"http://127.0.0.1:{port}", client)
    finally:
        server.should_exit = True
        await task
        sock.close()


Start = Callable[..., Awaitable[tuple[Sim, OpenAIAdapter]]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    async with AsyncExitStack() as stack:

        async def make(**kw: Any) -> tuple[Sim, OpenAIAdapter]:
            sim = await stack.enter_async_context(serve(SimConfig(profile="fast", **kw)))
            engine = await stack.enter_async_context(OpenAIAdapter(sim.url))
            return sim, engine

        yield make


def body(text: Any, **kw: Any) -> dict[str, Any]:
    return {"model": "sim-embed", "input": text, **kw}


def later(seconds: float = 30.0) -> float:
    return time.time() + seconds


async def test_concurrent_requests_share_one_engine_call_with_exact_usage(start: Start) -> None:
    sim, engine = await start()
    singles = [await engine.embed(body(t), f"single-{i}", {}) for i, t in enumerate(TEXTS)]
    before = await sim.embed_calls()
    sizes: list[int] = []
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05, observe=sizes.append)
    got = await asyncio.gather(
        *(batcher.embed(body(t), f"r{i}", {}, later()) for i, t in enumerate(TEXTS))
    )
    assert await sim.embed_calls() - before == 1
    assert sizes == [len(TEXTS)]
    for one, batched in zip(singles, got, strict=True):
        assert batched.vectors == one.vectors
        assert batched.usage == one.usage  # each request's own prompt tokens, exactly
    assert len({g.usage.prompt_tokens for g in got}) > 3  # the texts differ in length
    await batcher.aclose()


async def test_max_batch_counts_inputs_and_mixed_shapes_split_back(start: Start) -> None:
    sim, engine = await start()
    bodies = [
        body(["alpha beta", "gamma"]),  # two inputs
        body("delta epsilon zeta"),
        body(["eta", "theta iota", "kappa"]),  # three
        body("lambda"),
    ]
    singles = [await engine.embed(b, f"s{i}", {}) for i, b in enumerate(bodies)]
    before = await sim.embed_calls()
    sizes: list[int] = []
    batcher = EmbedBatcher(engine, max_batch=4, max_delay_s=0.05, observe=sizes.append)
    got = await asyncio.gather(
        *(batcher.embed(b, f"r{i}", {}, later()) for i, b in enumerate(bodies))
    )
    # 2+1 fit under 4; +3 would not: [2,1] goes, [3]+[1] makes the next.
    assert await sim.embed_calls() - before == 2
    assert sorted(sizes) == [2, 2]
    for one, batched in zip(singles, got, strict=True):
        assert batched.vectors == one.vectors
        assert batched.usage == one.usage


async def test_token_id_inputs_and_different_params_do_not_mix(start: Start) -> None:
    sim, engine = await start()
    bodies = [
        body([1, 2, 3]),
        body([[4, 5], [6, 7, 8, 9]]),
        body("text goes in another batch"),
        body([10, 11], dimensions=16),  # another dimension: another batch
    ]
    singles = [await engine.embed(b, f"s{i}", {}) for i, b in enumerate(bodies)]
    before = await sim.embed_calls()
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05)
    got = await asyncio.gather(
        *(batcher.embed(b, f"r{i}", {}, later()) for i, b in enumerate(bodies))
    )
    assert await sim.embed_calls() - before == 3
    for one, batched in zip(singles, got, strict=True):
        assert batched.vectors == one.vectors
        assert batched.usage == one.usage
    assert len(got[3].vectors[0]) == 16 * 4  # packed float32


async def test_batch_failure_fails_every_member_with_the_same_error(start: Start) -> None:
    _, engine = await start()
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05)
    fault = {"x-sim-fault": "503"}  # equal engine-facing headers: they batch together
    results = await asyncio.gather(
        *(batcher.embed(body(t), f"r{i}", fault, later()) for i, t in enumerate(TEXTS[:4])),
        return_exceptions=True,
    )
    assert all(isinstance(r, EngineUnavailable) for r in results)
    assert len({str(r) for r in results}) == 1
    assert batcher.engine_calls == 1


async def test_one_bad_input_fails_alone(start: Start) -> None:
    _, engine = await start(max_model_len=8)
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05)
    texts = ["short one", " ".join(["word"] * 40), "also short"]
    results = await asyncio.gather(
        *(batcher.embed(body(t), f"r{i}", {}, later()) for i, t in enumerate(texts)),
        return_exceptions=True,
    )
    assert isinstance(results[1], EngineRejected)
    ok = [await engine.embed(body(t), f"s{i}", {}) for i, t in enumerate(texts) if i != 1]
    assert [r.vectors for r in (results[0], results[2])] == [o.vectors for o in ok]  # type: ignore[union-attr]


async def test_deadlines_expired_never_batched_and_near_ones_flush_early(start: Start) -> None:
    sim, engine = await start()
    # A batch delay past the hang guard below: only a deadline can make it fire.
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=60.0)
    before = await sim.embed_calls()
    with pytest.raises(TimeoutError):
        await batcher.embed(body("late"), "expired", {}, time.time() - 1)
    assert await sim.embed_calls() == before
    waiting = asyncio.ensure_future(batcher.embed(body("patient"), "p", {}, later(120)))
    await until_true(lambda: batcher._tasks, "the patient request's batch open")
    async with asyncio.timeout(30):  # returning at all: not the 60 s batch delay
        hurried = await batcher.embed(body("hurried"), "h", {}, later(10))
        assert len((await waiting).vectors) == 1  # it went with the hurried one
    assert len(hurried.vectors) == 1
    assert await sim.embed_calls() - before == 1


async def test_members_that_leave_abort_the_batch_and_close_leaves_no_task(start: Start) -> None:
    sim, engine = await start()
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.2)
    before = await sim.embed_calls()
    calls = [
        asyncio.ensure_future(batcher.embed(body(t), f"r{i}", {}, later()))
        for i, t in enumerate(TEXTS)
    ]
    # One step of the loop puts each in the batch (nothing before that awaits);
    # they leave before the batch's task has run at all, so before it can fire,
    # however slow the box.
    await asyncio.sleep(0)
    assert sum(len(b.members) for b in batcher._pending.values()) == len(TEXTS)
    for c in calls:
        c.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    # The batch's task ends once its delay is up: nobody left waiting, never sent.
    await until_true(lambda: not batcher._tasks, "the abandoned batch's task ending")
    assert batcher.engine_calls == 0
    assert await sim.embed_calls() == before
    await batcher.aclose()

    # A batch delay past the test's hang guards: only closing ends this one.
    closing = EmbedBatcher(engine, max_batch=32, max_delay_s=60.0)
    # (Its deadline is past the delay too: a nearer one would fire the batch.)
    pending = asyncio.ensure_future(closing.embed(body("x"), "x", {}, later(120)))
    await until_true(lambda: _batches_waiting(closing), "x's batch waiting to fire")
    await closing.aclose()
    assert not closing._tasks
    with pytest.raises(EngineUnavailable):
        await pending  # closed before it fired: a retryable error, never a hang
    with pytest.raises(EngineUnavailable):
        await closing.embed(body("y"), "y", {}, later())
    assert closing.engine_calls == 0


async def test_closing_before_a_batch_task_first_runs_still_answers(start: Start) -> None:
    # A batch task cancelled before it first ran never entered its own handler,
    # and aclose() cleared the batches: its member waited for ever.
    _, engine = await start()
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=60.0)
    pending = asyncio.ensure_future(batcher.embed(body("x"), "x", {}, later(120)))
    # One loop turn: the request joins a new batch, whose task is scheduled after
    # this test's own turn (FIFO), so aclose() cancels it before it ever ran.
    await asyncio.sleep(0)
    assert batcher._pending
    assert not _batches_waiting(batcher)
    await batcher.aclose()
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(pending, 30)  # a hang guard only
    assert batcher.engine_calls == 0


def _batches_waiting(batcher: EmbedBatcher) -> bool:
    """A batch is open and its task has started (is suspended in its wait)."""
    return bool(batcher._tasks) and all(
        inspect.getcoroutinestate(t.get_coro()) == inspect.CORO_SUSPENDED  # type: ignore[arg-type]
        for t in batcher._tasks
    )


async def test_batch_of_one_is_the_unchanged_request(start: Start) -> None:
    _, engine = await start()
    batcher = EmbedBatcher(engine, max_batch=1, max_delay_s=0.05)
    got = await batcher.embed(body("alone", encoding_format="float"), "r", {}, later())
    one = await engine.embed(body("alone"), "s", {})
    assert got == one


def test_split_helpers() -> None:
    assert split_total(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(split_total(97, [5, 0, 11, 2])) == 97
    assert split_total(0, []) == []
    assert split_inputs("a") == ("text", ["a"])
    assert split_inputs([1, 2]) == ("tokens", [[1, 2]])
    assert split_inputs([[1], [2, 3]]) == ("tokens", [[1], [2, 3]])
    assert split_inputs(["a", [1]]) is None  # mixed: goes alone, the engine judges it
    assert split_inputs([]) is None
    assert split_inputs([True]) is None

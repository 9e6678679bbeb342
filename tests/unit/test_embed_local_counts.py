"""Exact usage of a batched embedding call counted in-process (issue 17, item 4):
the model's own tokenizer.json, loaded by the worker, instead of one engine
/tokenize call per input; and batching on only where it pays (auto mode). Against
the real simulator, with a tokenizer.json built here that tokenizes as it does."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from sim.config import SimConfig
from sim.tokenizer import _PIECE
from tests.unit.test_embed_batcher import TEXTS, Sim, body, later, serve
from workers.engines.openai import OpenAIAdapter
from workers.errors import TokenizerUnavailable
from workers.inference.batching import EmbedBatcher
from workers.inference.token_count import LocalTokenCounter

Start = Callable[..., Awaitable[tuple[Sim, OpenAIAdapter]]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    async with AsyncExitStack() as stack:

        async def make(**kw: Any) -> tuple[Sim, OpenAIAdapter]:
            sim = await stack.enter_async_context(serve(SimConfig(profile="fast", **kw)))
            engine = await stack.enter_async_context(OpenAIAdapter(sim.url))
            return sim, engine

        yield make


@pytest.fixture
def sim_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer.json that splits text into the simulator's pieces (one token each)."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE.pattern), behavior="isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path  # the directory, as --tokenizer takes a model's directory


async def stats(sim: Sim) -> dict[str, int]:
    r = await sim.client.get("/sim/stats")
    r.raise_for_status()
    return {k: int(r.json()[k]) for k in ("embeddings", "tokenize")}


async def test_local_counts_are_the_engines_without_a_tokenize_call(
    start: Start, sim_tokenizer: Path
) -> None:
    sim, engine = await start()
    singles = [await engine.embed(body(t), f"single-{i}", {}) for i, t in enumerate(TEXTS)]
    counter = LocalTokenCounter(sim_tokenizer)
    assert await counter.count(TEXTS) == [s.usage.prompt_tokens for s in singles]
    before = await stats(sim)
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05, counter=counter)
    got = await asyncio.gather(
        *(batcher.embed(body(t), f"r{i}", {}, later()) for i, t in enumerate(TEXTS))
    )
    after = await stats(sim)
    assert after["embeddings"] - before["embeddings"] == 1
    assert after["tokenize"] == before["tokenize"]  # no network call per input
    for one, batched in zip(singles, got, strict=True):
        assert batched.vectors == one.vectors
        assert batched.usage == one.usage
    await batcher.aclose()


@pytest.mark.parametrize("local", [True, False], ids=["tokenizer", "tokenize-calls"])
async def test_truncated_inputs_are_counted_as_the_engine_cuts_them(
    start: Start, sim_tokenizer: Path, local: bool
) -> None:
    """With ``truncate_prompt_tokens`` the engine cuts each input to K tokens: the
    inputs were counted whole, the counts disagreed with the engine's total, and
    each request's usage was a share by length instead of its own (the batch's
    sum stayed right, one tenant paid for another's tokens)."""
    sim, engine = await start()
    kw = {"truncate_prompt_tokens": 3}
    singles = [await engine.embed(body(t, **kw), f"single-{i}", {}) for i, t in enumerate(TEXTS)]
    assert {s.usage.prompt_tokens for s in singles} == {0, 1, 3}  # some cut, some not
    counter = LocalTokenCounter(sim_tokenizer) if local else None
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05, counter=counter)
    before = await stats(sim)
    got = await asyncio.gather(
        *(batcher.embed(body(t, **kw), f"r{i}", {}, later()) for i, t in enumerate(TEXTS))
    )
    assert (await stats(sim))["embeddings"] - before["embeddings"] == 1
    for one, batched in zip(singles, got, strict=True):
        assert batched.vectors == one.vectors
        assert batched.usage == one.usage
    await batcher.aclose()


async def test_without_a_tokenizer_the_engine_counts_each_input(start: Start) -> None:
    sim, engine = await start()
    before = await stats(sim)
    batcher = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05)
    got = await asyncio.gather(
        *(batcher.embed(body(t), f"r{i}", {}, later()) for i, t in enumerate(TEXTS[:4]))
    )
    after = await stats(sim)
    assert after["tokenize"] - before["tokenize"] == 4  # the fallback's cost
    assert after["embeddings"] - before["embeddings"] == 1
    assert [g.usage.prompt_tokens for g in got] == [len(_PIECE.findall(t)) for t in TEXTS[:4]]
    await batcher.aclose()


async def test_auto_batches_for_the_simulator_and_off_never_merges(start: Start) -> None:
    sim, engine = await start()
    assert await engine.batches_embeddings() is False  # it runs each call alone
    auto = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05, mode="auto")
    before = await stats(sim)
    await asyncio.gather(*(auto.embed(body(t), f"a{i}", {}, later()) for i, t in enumerate(TEXTS)))
    assert auto.batching is True
    assert (await stats(sim))["embeddings"] - before["embeddings"] == 1
    off = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05, mode="off")
    before = await stats(sim)
    await asyncio.gather(*(off.embed(body(t), f"o{i}", {}, later()) for i, t in enumerate(TEXTS)))
    after = await stats(sim)
    assert after["embeddings"] - before["embeddings"] == len(TEXTS)
    assert after["tokenize"] == before["tokenize"]  # alone: the engine's usage is the request's
    await auto.aclose()
    await off.aclose()


class _SlowToSay(OpenAIAdapter):
    """The real adapter, whose answer to "do you batch?" waits for the test."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.asked = 0
        self.was_asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def batches_embeddings(self) -> bool | None:
        self.asked += 1
        self.was_asked.set()
        await self.answer.wait()
        return await super().batches_embeddings()


async def test_requests_that_arrive_while_auto_asks_share_the_question_and_one_batch(
    start: Start,
) -> None:
    sim, _ = await start()
    async with _SlowToSay(sim.url) as engine:
        auto = EmbedBatcher(engine, max_batch=32, max_delay_s=0.05, mode="auto")
        before = await stats(sim)
        calls = [
            asyncio.ensure_future(auto.embed(body(t), f"s{i}", {}, later()))
            for i, t in enumerate(TEXTS)
        ]
        await engine.was_asked.wait()  # the first asked; the rest ran before this wakes
        engine.answer.set()
        await asyncio.gather(*calls)
        assert engine.asked == 1
        assert (await stats(sim))["embeddings"] - before["embeddings"] == 1
        await auto.aclose()


async def test_auto_waits_for_an_engine_that_cannot_answer() -> None:
    # Nothing listens there: unbatched for now, and asked again next time.
    async with OpenAIAdapter("http://127.0.0.1:9") as engine:
        assert await engine.batches_embeddings() is None
        batcher = EmbedBatcher(engine, mode="auto")
        assert await batcher._batching() is False
        assert batcher.batching is None


def test_a_tokenizer_that_cannot_be_loaded_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(TokenizerUnavailable, match="cannot load tokenizer"):
        LocalTokenCounter(tmp_path)  # no tokenizer.json in it
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerUnavailable, match="cannot load tokenizer"):
        LocalTokenCounter(tmp_path / "tokenizer.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the extra not installed
    with pytest.raises(TokenizerUnavailable, match=r"jetserve\[embed\]"):
        LocalTokenCounter(tmp_path)


def test_the_worker_refuses_to_start_with_a_tokenizer_it_cannot_load(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "jetserve", "worker", "--tokenizer", str(tmp_path),
         "--deployment-name", "m", "--deployment-engine", "e", "--nats", "nats://127.0.0.1:9",
         "--insecure"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert "cannot load tokenizer" in done.stderr


async def test_counting_runs_off_the_event_loop(sim_tokenizer: Path) -> None:
    """A batch of long inputs took the tokenizer seconds: counted on the event loop,
    it stalled the worker's other streams past the gateway's heartbeat timeout."""
    counter = LocalTokenCounter(sim_tokenizer)
    ticks = 0
    stop = asyncio.Event()

    async def ticking() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(ticking())
    await asyncio.sleep(0)
    before = ticks
    texts = ["many words here " * 20_000] * 8
    counts = await counter.count(texts)
    during = ticks - before
    stop.set()
    await ticker
    assert counts == counter.count_now(texts)
    assert during > 0  # the loop went on while the tokenizer ran

"""Choices through the prompt-string adapters, against the simulator's dialects: TGI's
``n`` as parallel requests (cancelled together), Triton's native ``n``, and ``best_of``
on each."""

from __future__ import annotations

from typing import Any

from tests.sim.simkit import SimHandle
from tests.waits import until
from workers.engines.base import Delta, Done, EngineAdapter, closing
from workers.engines.tgi import TGIAdapter
from workers.engines.triton import TritonAdapter

BODY = {"prompt": "A colour:", "max_tokens": 6, "seed": 5}


async def _run(adapter: EngineAdapter, body: dict[str, Any]) -> tuple[list[Delta], Done]:
    deltas: list[Delta] = []
    done: Done | None = None
    async with closing(adapter.generate("completion", body, "rid", {"X-Sim-Fault": "none"})) as ev:
        async for e in ev:
            if isinstance(e, Delta):
                deltas.append(e)
            else:
                done = e
    assert done is not None
    return deltas, done


def _texts(deltas: list[Delta]) -> dict[int, str]:
    out: dict[int, str] = {}
    for d in deltas:
        out[d.index] = out.get(d.index, "") + d.text
    return out


async def test_tgi_n_is_parallel_requests_and_usage_sums(fast: SimHandle) -> None:
    async with TGIAdapter(fast.url) as adapter:
        deltas, done = await _run(adapter, {**BODY, "n": 3})
        one, single = await _run(adapter, BODY)
    texts = _texts(deltas)
    assert sorted(texts) == [0, 1, 2]
    assert len(set(texts.values())) == 3  # seeds 5, 6, 7
    assert texts[0] == _texts(one)[0]  # choice 0 is the request itself
    assert done.usage.prompt_tokens == single.usage.prompt_tokens
    assert done.usage.completion_tokens == 3 * single.usage.completion_tokens


async def test_tgi_cancelling_n_aborts_every_request(fast: SimHandle) -> None:
    before = (await fast.stats())["aborted"]
    headers = {"X-Sim-Fault": "slow:50"}
    body = {**BODY, "n": 3, "max_tokens": 200}
    adapter = TGIAdapter(fast.url)
    async with adapter, closing(adapter.generate("completion", body, "rid", headers)) as events:
        async for ev in events:
            if isinstance(ev, Delta) and ev.text:
                break
    stats: dict[str, Any] = {}

    async def all_aborted() -> bool:
        nonlocal stats
        stats = await fast.stats()
        return bool(stats["aborted"] - before == 3 and stats["running"] == 0)

    await until(all_aborted, "the three choices' aborts", every_s=0.01)
    assert stats["aborted"] - before == 3
    assert stats["running"] == 0


async def test_triton_n_is_native_and_best_of_keeps_the_likeliest(fast: SimHandle) -> None:
    async with TritonAdapter(fast.url, model="sim-8b") as adapter:
        deltas, done = await _run(adapter, {**BODY, "n": 2})
        best, best_done = await _run(adapter, {**BODY, "best_of": 3, "logprobs": 0})
    texts = _texts(deltas)
    assert sorted(texts) == [0, 1]
    assert texts[0] != texts[1]
    assert all(d.finish_reason in (None, "length", "stop") for d in deltas)
    assert done.usage.completion_tokens == 12
    # best_of: one choice, whole, out of 3 sequences (all of them counted).
    assert [d.index for d in best] == [0]
    assert best_done.usage.completion_tokens == 18
    assert best[0].logprobs is not None


async def test_tgi_best_of_uses_generate(fast: SimHandle) -> None:
    body = {"prompt": "A colour:", "max_tokens": 6, "best_of": 2}
    async with TGIAdapter(fast.url) as adapter:
        deltas, done = await _run(adapter, body)
    assert {d.index for d in deltas} == {0}
    assert done.usage.prompt_tokens > 0  # counted from decoder_input_details' prefill
    assert done.usage.completion_tokens == 6

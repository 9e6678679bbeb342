"""``n`` choices merged from n single-sequence streams (workers/engines/fanout.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from streams.wire import Usage
from tests.waits import until
from workers.engines.base import Delta, Done
from workers.engines.fanout import QUEUED, merged


async def test_a_slow_consumer_holds_the_streams_back_not_the_memory() -> None:
    """The queue between the n streams and the consumer had no bound: a consumer
    slower than the engine (frames to a slow bus) let every event of every choice
    pile up in the worker. Now the streams are read only as far as the queue's
    bound ahead of the consumer."""
    produced = [0, 0]

    def source(j: int) -> AsyncIterator[Delta | Done]:
        async def events() -> AsyncIterator[Delta | Done]:
            for i in range(10_000):
                produced[j] += 1
                yield Delta(f"{j}:{i}", index=j)
            yield Done("stop", Usage(prompt_tokens=3, completion_tokens=10_000))

        return events()

    stream = merged(source, 2)
    first = await anext(stream)
    assert isinstance(first, Delta)

    async def filled() -> bool:  # the streams ran while the consumer did not read
        return sum(produced) >= QUEUED + 2

    await until(filled, "the queue filled")
    assert sum(produced) <= QUEUED + 3  # the bound, each pump's one in hand, the one read
    rest = [first, *[e async for e in stream]]
    done = rest.pop()
    assert isinstance(done, Done)
    assert done.usage == Usage(prompt_tokens=3, completion_tokens=20_000)
    texts = [e.text for e in rest if isinstance(e, Delta)]
    assert sorted(texts) == sorted(f"{j}:{i}" for j in range(2) for i in range(10_000))

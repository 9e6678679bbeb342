"""``n`` choices from an engine that makes one sequence per request: ``n`` requests side
by side, their events merged as they come, each Delta carrying its choice's index, and
one Done whose usage counts the prompt once and every choice's tokens.

Closing the merged stream (a cancelled consumer) closes every request. The events
wait in a bounded queue: a consumer slower than the engine (frames to a slow bus)
holds the requests back (their sockets stop being read), not the worker's memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from streams.wire import Usage
from workers.engines.base import Delta, Done, closing

Source = Callable[[int], AsyncIterator[Delta | Done]]
_END = object()
QUEUED = 64  # events waiting for the consumer, all choices together


async def merged(source: Source, n: int) -> AsyncIterator[Delta | Done]:
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue(QUEUED)

    async def pump(j: int) -> None:
        try:
            async with closing(source(j)) as events:
                async for ev in events:
                    await queue.put((j, ev))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer, below
            await queue.put((j, exc))
            return
        await queue.put((j, _END))

    tasks = [asyncio.create_task(pump(j)) for j in range(n)]
    dones: dict[int, Done] = {}
    try:
        ended = 0
        while ended < n:
            j, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _END:
                ended += 1
            elif isinstance(item, Done):
                dones[j] = item
            elif isinstance(item, Delta):
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    first = dones[0]
    usage = Usage(
        prompt_tokens=first.usage.prompt_tokens,
        completion_tokens=sum(d.usage.completion_tokens for d in dones.values()),
    )
    yield Done(first.finish_reason, usage, first.model)

"""Waiting on a condition, never on a sleep: the one poll loop every test uses.
The bound only turns a hang into a failure; a loaded 2-core box takes seconds
where an idle one takes milliseconds, so bounds are generous."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx


async def until(
    check: Callable[[], Awaitable[object]], what: str, bound_s: float = 30.0, every_s: float = 0.05
) -> float:
    """Poll the async ``check`` until it is truthy; the seconds it took. Fails
    (AssertionError naming ``what``) after ``bound_s``."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < bound_s, f"gave up waiting for {what} after {bound_s}s"
        await asyncio.sleep(every_s)
    return time.monotonic() - t0


async def until_sync(cond: Callable[[], object], what: str, bound_s: float = 30.0) -> float:
    """:func:`until` for a blocking ``cond`` (run on a thread, off the loop)."""

    async def check() -> object:
        return await asyncio.to_thread(cond)

    return await until(check, what, bound_s)


async def until_true(cond: Callable[[], object], what: str, bound_s: float = 30.0) -> float:
    """:func:`until` for a cheap predicate read on the loop (no thread, no I/O)."""

    async def check() -> object:
        return cond()

    return await until(check, what, bound_s)


async def until_streamed(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], what: str
) -> float:
    """Until a GET of the stream at ``url`` is served (200) again: a bound on
    open streams counts one out once the gateway saw it end."""

    async def served() -> bool:
        async with client.stream("GET", url, headers=headers) as again:
            return again.status_code == 200

    return await until(served, what)

"""A run's followed events (gateway/runs/service.py EventFeed): what following
them holds is given back on close, whether or not they were ever read."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from gateway.runs.service import EventFeed
from gateway.runs.views import Ended, Idle, RunStreamItem


async def test_a_feed_closed_unread_gives_back_what_it_holds() -> None:
    # An async generator closed before its first step runs none of its body: its
    # finally (where the follower's slot was given back) never ran.
    ran: list[str] = []

    async def items() -> AsyncGenerator[RunStreamItem, None]:
        try:
            yield Idle()
        finally:
            ran.append("finally")

    released: list[int] = []

    async def release() -> None:
        released.append(1)

    feed = EventFeed(items(), release)
    await feed.aclose()
    assert ran == []  # the generator's body never ran...
    assert released == [1]  # ...and what it held is back all the same


async def test_a_feed_reads_its_items_then_gives_back_on_close() -> None:
    async def items() -> AsyncGenerator[RunStreamItem, None]:
        yield Idle()
        yield Ended()

    released: list[int] = []

    async def release() -> None:
        released.append(1)

    feed = EventFeed(items(), release)
    assert [type(i) async for i in feed] == [Idle, Ended]
    await feed.aclose()
    assert released == [1]

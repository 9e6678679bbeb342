"""streams/tasks.py: a task that swallowed a cancel is still stopped."""

from __future__ import annotations

import asyncio

import pytest

from streams.tasks import stop_task


async def test_a_task_that_swallows_one_cancel_is_stopped() -> None:
    swallowed, waiting = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        # What Python 3.11's wait_for does when a cancel races its inner future.
        try:
            waiting.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(stubborn())
    await waiting.wait()  # inside its first wait: the first cancel lands there
    await stop_task(task)
    assert swallowed.is_set()
    assert task.cancelled()


async def test_an_error_the_task_ended_with_is_raised() -> None:
    async def failing() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(failing())
    await asyncio.wait({task})
    with pytest.raises(ValueError, match="broken"):
        await stop_task(task)

"""workers/agent/guard.py: a cancel notice interrupts a step's wait at once, even
a wait that drops the first cancel (Python 3.11's wait_for inside nats-py's
request does when the cancel lands as its reply arrives: streams/tasks.py)."""

from __future__ import annotations

import asyncio

import pytest

from workers.agent.errors import StepInterrupted
from workers.agent.guard import Guard


async def test_a_cancel_notice_ends_a_wait_that_drops_one_cancel() -> None:
    guard = Guard("run_1")
    inside, dropped, ended = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def model_call() -> str:
        try:
            try:
                inside.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                dropped.set()  # as wait_for does: the reply is in, the cancel is lost
            await asyncio.Event().wait()  # reading the rest of the answer
            return "the whole answer"
        finally:
            ended.set()

    async def notice() -> None:
        await inside.wait()
        guard.cancelled.set()

    noticing = asyncio.create_task(notice())
    with pytest.raises(StepInterrupted):
        await guard.interruptible(model_call())
    await noticing
    assert dropped.is_set()  # the first cancel landed and was dropped...
    assert ended.is_set()  # ...and the call still ended before the interruption


async def test_an_answer_before_any_notice_is_returned() -> None:
    guard = Guard("run_1")

    async def model_call() -> str:
        return "answer"

    assert await guard.interruptible(model_call()) == "answer"

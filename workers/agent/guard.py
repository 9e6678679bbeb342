"""Interrupting a step: a cancel notice for a run, or for any of its ancestors,
stops the step's waits (a model call, a read-only tool) at once. Effectful tool
calls are never interrupted half-way: they finish and record their outcome, and
the cancel takes effect right after."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from streams.agent import Run
from streams.tasks import stop_task
from workers.agent.errors import StepInterrupted

T = TypeVar("T")


class Guard:
    def __init__(self, run_id: str) -> None:
        self.cancelled = asyncio.Event()
        self.scope: frozenset[str] = frozenset({run_id})
        # The effectful call in flight, if any: the executor's watchdog and drain
        # wait for it (bounded by the tool's own timeout) instead of cutting it.
        self.effect: asyncio.Future[Any] | None = None

    async def effectful(self, work: Awaitable[T]) -> T:
        """``await work`` (an effectful tool call), never cut half-way: a cancel of
        the step reaches this await, not the call, which goes on to record its
        outcome (the executor waits for it: :attr:`effect`)."""
        task = asyncio.ensure_future(work)
        self.effect = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():  # else cut from the step: the executor adopts it
                self.effect = None

    def bind(self, run: Run) -> None:
        # A cancel notice names a run, an ancestor, or the revoked key that started them.
        self.scope = frozenset({run.id, *run.ancestors, *([run.key_id] if run.key_id else [])})

    async def interruptible(self, work: Awaitable[T]) -> T:
        """``await work`` unless a cancel notice arrives first (StepInterrupted)."""
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.cancelled.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we were cancelled ourselves: take the work down too
            await stop_task(task)
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        # Until done: a model call's publish can drop one cancel (streams/tasks.py),
        # and the interruption would then wait for the whole answer.
        await stop_task(task)
        raise StepInterrupted("a cancel of this run (or an ancestor) arrived")

"""The NATS ingress's task bound (gateway/ingress/nats_tasks.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from gateway.ingress.nats_tasks import IngressTasks, Known


class Requests:
    """Served messages that wait to be let go; each says when it started."""

    def __init__(self) -> None:
        self.knowns: dict[int, Known] = {}
        self.started: dict[int, asyncio.Event] = {}
        self.gates: dict[int, asyncio.Event] = {}

    def serve(self, i: int) -> Callable[[Known], Coroutine[Any, Any, None]]:
        self.started[i], self.gates[i] = asyncio.Event(), asyncio.Event()

        async def run(known: Known) -> None:
            self.knowns[i] = known
            self.started[i].set()
            await self.gates[i].wait()

        return run


async def test_at_most_limit_are_unauthenticated_and_a_checked_key_frees_its_slot() -> None:
    work, reqs = IngressTasks(2), Requests()
    await work.spawn(reqs.serve(0))
    await work.spawn(reqs.serve(1))
    third = asyncio.create_task(work.spawn(reqs.serve(2)))
    await reqs.started[0].wait()
    await reqs.started[1].wait()
    assert not third.done()  # waits for a slot
    assert len(work.tasks) == 2
    assert work.unauthenticated == 2
    reqs.knowns[0]()  # the first's key checked: it goes on, counted by its tenant now
    await third
    await reqs.started[2].wait()
    assert len(work.tasks) == 3
    assert work.unauthenticated == 2
    reqs.knowns[0]()  # a second call changes nothing
    assert work.unauthenticated == 2
    reqs.gates[1].set()  # the second ends unchecked (a dropped request): its slot is back
    await work.spawn(reqs.serve(3))
    assert work.unauthenticated == 2
    for gate in reqs.gates.values():
        gate.set()
    await asyncio.gather(*work.tasks)
    assert work.unauthenticated == 0
    assert not work.tasks


async def test_a_task_cancelled_before_it_ran_gives_its_slot_back() -> None:
    work, reqs = IngressTasks(1), Requests()
    await work.spawn(reqs.serve(0))
    (task,) = work.tasks
    task.cancel()  # at stop(), before the loop ran it
    await asyncio.gather(task, return_exceptions=True)
    assert not reqs.started[0].is_set()
    assert work.unauthenticated == 0
    assert not work.tasks
    await asyncio.wait_for(work.spawn(reqs.serve(1)), 5)  # the slot is free again
    reqs.gates[1].set()
    await asyncio.gather(*work.tasks)


def test_the_limit_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        IngressTasks(0)

"""Stopping an owned background task for certain.

Python 3.11's ``asyncio.wait_for`` (nats-py's request waits with it) drops a
cancel that lands as its inner future completes (CPython gh-86296, fixed in
3.12). A polling loop around such a request then runs on after ``cancel()``,
and whoever awaits it waits forever; so stopping cancels again until the task
is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any


async def stop_task(task: asyncio.Task[Any], every_s: float = 0.1) -> None:
    """Cancel ``task`` until it is done; an error it ended with is raised here."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every_s)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


def _awaiting(task: asyncio.Task[Any]) -> str:
    """The chain of awaits a suspended task is parked in, outermost first."""
    where = []
    obj: Any = task.get_coro()
    while obj is not None:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is None:
            where.append(type(obj).__name__)  # a Future, or a finished coroutine
            break
        code = frame.f_code
        where.append(f"{code.co_name} ({code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno})")
        obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
    return " -> ".join(where)


def dump_tasks(log: logging.Logger) -> None:
    """Log every task of the running loop with the await it is parked in (an
    operator's SIGUSR1: what a stuck process waits on)."""
    tasks = asyncio.all_tasks()
    log.warning("%d tasks", len(tasks))
    for task in tasks:
        log.warning("task %s: %s", task.get_name(), _awaiting(task))


def install_task_dump(log: logging.Logger) -> None:
    """SIGUSR1 -> :func:`dump_tasks` (Unix; a no-op where signals are not supported)."""
    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks, log)

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
from typing import Any


async def stop_task(task: asyncio.Task[Any], every_s: float = 0.1) -> None:
    """Cancel ``task`` until it is done; an error it ended with is raised here."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every_s)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()

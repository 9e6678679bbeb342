"""Asking again when a JetStream request times out at start-up.

A cluster that has just formed (or lost a node) answers API requests late while
it elects a stream's leader: a lookup times out, and a process that gives up on
it dies at start. Only timeouts are asked again; any other answer is final.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors

T = TypeVar("T")

START_WITHIN_S = 60.0  # how long a start-up lookup that times out is asked again


def _timed_out(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:  # the timeout may be the cause of a wrapping error
        if isinstance(seen, (nats.errors.TimeoutError, TimeoutError)):
            return True
        seen = seen.__cause__
    return False


async def patiently(call: Callable[[], Awaitable[T]], within_s: float = START_WITHIN_S) -> T:
    """``call()``, again every 0.5 s while it times out, for up to ``within_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while True:
        try:
            return await call()
        except Exception as exc:  # re-raised below unless it is a timeout
            if not _timed_out(exc) or loop.time() > end:
                raise
        await asyncio.sleep(0.5)

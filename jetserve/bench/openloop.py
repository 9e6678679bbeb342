"""The one open-loop driver of the bench package: start each request at its
arrival time, whether or not earlier ones have answered.

Both load generators use it: ``loadgen.run_job`` (a precomputed schedule) and
the fleet scenarios' client (``fleet/client.py``, arrivals drawn as it goes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

EARLY_S = 0.0005  # close enough: send now rather than sleep again
WAKE_TRIES = 3  # timers may fire a little early; sleep again rather than send early


async def open_loop(
    offsets: Iterable[float],
    start: Callable[[int], Coroutine[Any, Any, T]],
    *,
    t0: float,
    clock: Callable[[], float] = time.perf_counter,
) -> list[T]:
    """Run ``start(i)`` at ``t0 + offsets[i]`` on ``clock``, each as its own task,
    and return their results in arrival order once all are done. ``offsets`` may
    be lazy: each is read only after the previous request started. A failure or
    cancellation cancels the requests still open."""
    tasks: list[asyncio.Task[T]] = []
    try:
        for i, at in enumerate(offsets):
            for _ in range(WAKE_TRIES):
                delay = t0 + at - clock()
                if delay <= EARLY_S:
                    break
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(start(i)))
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()

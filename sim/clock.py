"""The engine's clock: real (the event loop's) or virtual (steps take no real time).

The engine reads time and waits only through its clock, so a test can run the same
scheduler and latency model on a virtual clock and measure TTFT and ITL in model time,
independent of how loaded the machine is.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None:
        """One step's time. Always yields to the event loop, even for 0."""

    async def wait(self, event: asyncio.Event, deadline: float | None) -> None:
        """Until `event` is set or the clock reaches `deadline` (None: no deadline)."""


# A step that starts within this long of the previous step's end runs back to back
# with it: it keeps the previous step's schedule instead of starting from now.
_BACK_TO_BACK_S = 0.002


class RealClock:
    """The event loop's time. The loop's timers fire up to ~1 ms off (uvloop cuts a
    delay to whole milliseconds), so back-to-back steps are timed against their own
    schedule: each ends `seconds` after the previous one's due end, a late timer is
    made up on the next step, and the time the woken clients take between two steps
    overlaps the next one (vLLM processes a step's output while the next runs)."""

    def __init__(self) -> None:
        self._due = float("-inf")

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        now = self.now()
        start = self._due if now - self._due < _BACK_TO_BACK_S else now
        self._due = start + max(seconds, 0.0)
        delay = self._due - now
        await asyncio.sleep(delay if delay > 0.0 else 0)

    async def wait(self, event: asyncio.Event, deadline: float | None) -> None:
        if deadline is None:
            await event.wait()
            return
        # One timer for the whole idle wait, not a poll.
        handle = asyncio.get_running_loop().call_at(deadline, event.set)
        try:
            await event.wait()
        finally:
            handle.cancel()


class VirtualClock:
    """Model time: a step advances it by its duration at once; an idle engine with a
    timer pending jumps to the timer once the event loop has nothing else to run."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)
        await asyncio.sleep(0)

    async def wait(self, event: asyncio.Event, deadline: float | None) -> None:
        if deadline is None:
            await event.wait()
            return
        for _ in range(3):  # let ready callbacks (consumers re-arming) run first
            if event.is_set():
                return
            await asyncio.sleep(0)
        if not event.is_set():
            self.t = max(self.t, deadline)

"""A small progress bar on stderr (no tqdm): one bar over every run of a sweep.

On a terminal it redraws one line; elsewhere (CI logs, pipes) it prints a plain line
every few seconds and at the end of each run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def _clock_text(seconds: float) -> str:
    s = max(int(seconds), 0)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ProgressBar:
    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        *,
        width: int = 24,
        enabled: bool = True,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self._clock = clock
        self._start = clock()
        self._last_draw = -1e9
        self._finished = 0  # requests of runs already over
        self._label = ""
        self._run_total = 0
        self._state = (0, 0, 0)

    def extend(self, n: int) -> None:
        """More requests to come than planned (a run repeated)."""
        self.total += n

    def start_run(self, label: str, n: int) -> None:
        self._label = label
        self._run_total = n
        self._state = (0, 0, 0)
        self._draw(force=True)

    def update(self, sent: int, done: int, bad: int) -> None:
        self._state = (sent, done, bad)
        self._draw()

    def end_run(self) -> None:
        self._state = (self._run_total, self._run_total, self._state[2])
        self._draw(force=True, newline=not self.tty)
        self._finished += self._run_total

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def render(self) -> str:
        sent, done, bad = self._state
        frac = min((self._finished + done) / self.total, 1.0)
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = self._clock() - self._start
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        return (
            f"[{bar}] {frac * 100:3.0f}% {self._label}  sent {sent}/{self._run_total}"
            f" done {done} bad {bad}  {_clock_text(elapsed)} (eta {_clock_text(eta)})"
        )

    def _draw(self, *, force: bool = False, newline: bool = False) -> None:
        if not self.enabled:
            return
        now = self._clock()
        # Terminals redraw 10 times a second; logs get a line every 5 s.
        interval = 0.1 if self.tty else 5.0
        if not force and now - self._last_draw < interval:
            return
        self._last_draw = now
        line = self.render()
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        elif newline or not force:
            self.stream.write(line + "\n")
        self.stream.flush()

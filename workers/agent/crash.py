"""Crash injection for the crash matrix: ``--crash-at POINT:PROBABILITY``.

At a named point of a step the executor SIGKILLs itself (no cleanup, no ack, no
flush: exactly what a power cut or an OOM kill does) with the given probability.
The draw is a hash of (point, run, step, call), so it is reproducible for a run,
and it fires at most once per (point, run, step, call): the redelivered step must
be able to finish, or a run could be killed forever. With a crash log the log
itself remembers (it outlives the killed process); without one, only the first
delivery of a step message can fire.

Points, in the order a step meets them:

- ``model_call``: the inference request is published, its answer not yet recorded;
- ``after_intent``: the effect ledger holds the intent, the effect has not run;
- ``after_effect``: the effect ran, its outcome is not recorded anywhere;
- ``after_outcome``: the ledger holds the outcome, the run record does not;
- ``before_ack``: the run is persisted and the next step enqueued, the step
  message is not acked.

With ``--crash-log FILE`` each kill first appends ``{"point", "run", "step",
"call", "pid", "at"}`` as a JSON line (fsynced), so a test can tell which runs it
hit (and the next executor does not kill itself at the same place again).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import signal
import time
from collections.abc import Iterable
from typing import Final

from workers.agent.errors import CrashSpecError

POINTS: Final = ("model_call", "after_intent", "after_effect", "after_outcome", "before_ack")

# The delivery number of the step message being handled (set per handler task;
# tools running inside the step see it too).
DELIVERY: contextvars.ContextVar[int] = contextvars.ContextVar("agent_delivery", default=0)
# When that message was stored (epoch seconds; 0: unknown).
STORED_AT: contextvars.ContextVar[float] = contextvars.ContextVar("agent_stored_at", default=0.0)


def parse_crash_specs(items: Iterable[str]) -> dict[str, float]:
    spec: dict[str, float] = {}
    for item in items:
        point, sep, prob = item.partition(":")
        if point not in POINTS or not sep:
            raise CrashSpecError(f"--crash-at {item!r}: expected one of {POINTS}:PROBABILITY")
        try:
            p = float(prob)
        except ValueError:
            raise CrashSpecError(f"--crash-at {item!r}: probability is not a number") from None
        if not 0.0 <= p <= 1.0:
            raise CrashSpecError(f"--crash-at {item!r}: probability must be in [0, 1]")
        spec[point] = p
    return spec


class CrashPoints:
    def __init__(self, spec: dict[str, float] | None = None, log_path: str | None = None) -> None:
        self.spec = dict(spec or {})
        self.log_path = log_path

    def __bool__(self) -> bool:
        return any(p > 0 for p in self.spec.values())

    def draw(self, point: str, run_id: str, step: int, call_id: str = "") -> bool:
        """The (reproducible) draw alone: would this place be chosen to crash?"""
        p = self.spec.get(point, 0.0)
        digest = hashlib.sha256(f"{point}|{run_id}|{step}|{call_id}".encode()).digest()
        return p > 0.0 and int.from_bytes(digest[:8], "big") / 2**64 < p

    def hits(self, point: str, run_id: str, step: int, call_id: str = "") -> bool:
        if not self.draw(point, run_id, step, call_id):
            return False
        if self.log_path is None:
            return DELIVERY.get() == 1
        return not self._logged(point, run_id, step, call_id)

    def _logged(self, point: str, run_id: str, step: int, call_id: str) -> bool:
        try:
            with open(self.log_path or "") as fh:
                lines = fh.read().splitlines()
        except FileNotFoundError:
            return False
        for line in lines:
            try:
                c = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill mid-write
                continue
            if (c.get("point"), c.get("run"), c.get("step"), c.get("call", "")) == (
                point,
                run_id,
                step,
                call_id,
            ):
                return True
        return False

    def maybe(self, point: str, run_id: str, step: int, call_id: str = "") -> None:
        if self.hits(point, run_id, step, call_id):
            self._die(point, run_id, step, call_id)

    def _die(self, point: str, run_id: str, step: int, call_id: str) -> None:
        if self.log_path:
            line = json.dumps(
                {
                    "point": point,
                    "run": run_id,
                    "step": step,
                    "call": call_id,
                    "pid": os.getpid(),
                    "at": time.time(),
                }
            )
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

"""CPU time of local processes (Linux /proc), sampled around each run.

With `--fleet` every component is a local process, so a run can say what each one
spent: on a small machine a gateway that burns CPU slows the engine beside it, and
that is part of what the benchmark measures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

_PROC = Path("/proc")


def _ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of user + system) of one live process."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _ticks()
    except (IndexError, ValueError):
        return None


def tree_cpu(roots: list[int]) -> float:
    """CPU seconds of these processes and all their descendants (worker pools)."""
    stats: dict[int, tuple[int, float]] = {}
    if _PROC.is_dir():
        for entry in _PROC.iterdir():
            if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
                stats[int(entry.name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total = 0.0
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


def machine_busy() -> float | None:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    try:
        head = (_PROC / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not head or head[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait.
    vals = [int(v) for v in head[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / _ticks()


def self_cpu() -> float | None:
    """This process and its reaped children (the load generator subprocesses)."""
    try:
        text = (_PROC / "self" / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return sum(int(f) for f in fields[11:15]) / _ticks()


class CpuMeter:
    """CPU seconds per named group of processes, e.g. {"gateway": [pid], ...}."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = {k: v for k, v in groups.items() if v}

    @property
    def enabled(self) -> bool:
        return _PROC.is_dir()

    def sample(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        out = {name: tree_cpu(pids) for name, pids in self.groups.items()}
        machine, own = machine_busy(), self_cpu()
        if machine is not None and own is not None:
            out["_machine"], out["_self"] = machine, own
        return out

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """CPU seconds per group between two samples, plus `other`: what processes
        outside the benchmark (and its generator) took from the same cores."""
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        machine, own = d.pop("_machine", None), d.pop("_self", None)
        if machine is not None and own is not None:
            d["other"] = max(machine - own - sum(d.values()), 0.0)
        return {k: round(v, 3) for k, v in d.items()}


def wait_quiet(
    meter: CpuMeter,
    max_cores: float,
    timeout: float,
    *,
    window: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """Wait until processes outside the benchmark use at most `max_cores` over a
    `window` (a shared machine: someone else's test run), for at most `timeout` s.
    Returns their last use in cores, None where it cannot be read."""
    end = time.monotonic() + timeout
    while True:
        before = meter.sample()
        sleep(window)
        other = CpuMeter.delta(before, meter.sample()).get("other")
        if other is None:
            return None
        cores = other / window
        if cores <= max_cores or time.monotonic() >= end:
            return cores


def parse_cpu_list(text: str) -> set[int]:
    """A taskset/cpuset list ("1", "0-2,5") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def keep_off(engine_cpus: str | None) -> list[int] | None:
    """Pin this process (and so what it starts after: the fleets, the load
    generator) to the CPUs the engine was not given, as a host with an
    accelerator leaves its cores to the path. Unpinned, the path's processes
    woke on the engine's core behind its busy-polling threads and waited there
    (single-input embeddings on vLLM, 8 clients: 0.68 of direct unpinned, 0.83
    pinned). The CPUs taken, or None when the engine is not pinned ("all",
    unset) or would leave nothing."""
    if not engine_cpus or engine_cpus == "all" or not hasattr(os, "sched_setaffinity"):
        return None
    rest = sorted(os.sched_getaffinity(0) - parse_cpu_list(engine_cpus))
    if not rest:
        return None
    os.sched_setaffinity(0, rest)
    return rest

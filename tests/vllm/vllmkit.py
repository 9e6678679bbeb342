"""Helpers of the real-vLLM tier: the server handle, starting and stopping vLLM, its
RSS. Fixtures live in conftest.py; tests import from here (a module name of its own,
since conftest modules from several directories share one name)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "bench" / "peers" / "vllm.sh"
STARTUP_S = 180.0  # 20-60 s measured on 2 cores; generous for a loaded machine


@dataclass(frozen=True)
class VllmServer:
    url: str
    model: str
    startup_s: float | None = None  # None: started by someone else
    rss_mb: float | None = None


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants (API server, EngineCore, worker)."""
    total_kb, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited between listing and reading
    return total_kb / 1024


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Spawned EngineCore / worker processes left behind by an unclean exit.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def peer_process(
    argv: list[str],
    *,
    env: dict[str, str],
    log: Path,
    ready: Callable[[], bool],
    name: str,
    startup_s: float,
    poll_s: float = 0.5,
) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """A real engine (``argv``, in its own process group, output to ``log``)
    until ``ready``: (the process, seconds it took). Polled on its readiness,
    failing the tier with the log's tail if it exits or outlasts ``startup_s``;
    the whole group is stopped at the end."""
    t0 = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited ({proc.returncode}):\n{tail(log)}")
            if time.monotonic() - t0 > startup_s:
                pytest.fail(f"{name} not ready after {startup_s:.0f}s:\n{tail(log)}")
            time.sleep(poll_s)  # a poll on its readiness, not a wait for time to pass
        yield proc, time.monotonic() - t0
    finally:
        stop(proc)

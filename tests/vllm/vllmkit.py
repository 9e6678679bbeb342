"""Helpers of the real-vLLM tier: the server handle, starting and stopping vLLM, its
RSS. Fixtures live in conftest.py; tests import from here (a module name of its own,
since conftest modules from several directories share one name)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

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

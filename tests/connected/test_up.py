"""`jetserve up --check` (the README's first command, `make up ARGS=--check`):
the whole product on loopback, a chat and an agent run with an approval."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]


def test_up_runs_a_chat_and_an_approved_agent_run() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jetserve", "up", "--check", "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("self-check: ") and "usage:" in line for line in lines)
    agent = next(line for line in lines if line.startswith("agent run : "))
    assert "awaiting_approval" in agent
    assert "completed: 'Paid carol 30.'" in agent
    # The printed examples name the run's approval route and the WebSocket.
    assert "/approvals/call_1" in out.stdout
    assert "/v1/ws" in out.stdout
    assert "/playground#key=" in out.stdout  # the page, both keys filled in
    # Stopped, it leaves nothing behind: its stores, logs and secrets went with it.
    ready = re.search(r"\(logs: (\S+)\)", out.stdout)
    assert ready is not None, out.stdout
    assert not Path(ready.group(1)).exists()

"""The real-engine tiers' start-up loop (tests/vllm/vllmkit.py peer_process),
on a stand-in peer that runs here (Python's http.server): it waits for
readiness, reports a peer that exits, and stops the whole process group."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from jetserve.services import free_port
from tests.vllm.vllmkit import peer_process


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def test_a_peer_is_waited_for_and_stopped(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    called = time.monotonic()
    with peer_process(
        argv, env=dict(os.environ), log=tmp_path / "peer.log", ready=lambda: _up(url),
        name="http.server", startup_s=30, poll_s=0.05,
    ) as (proc, startup):  # fmt: skip
        assert _up(url)
        # The start-up it reports is a real duration within the call's own.
        assert 0 < startup <= time.monotonic() - called
    assert proc.poll() is not None  # stopped with its group


def test_a_peer_that_exits_fails_the_tier_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with (
        pytest.raises(pytest.fail.Exception, match="no model here"),
        peer_process(
            argv, env=dict(os.environ), log=tmp_path / "peer.log", ready=lambda: False,
            name="peer", startup_s=30, poll_s=0.05,
        ),
    ):  # fmt: skip
        pytest.fail("never reached")

"""`jetserve routes ...` run as an operator would, against a test fleet's admin API."""

from __future__ import annotations

import os
import subprocess
import sys

from jetserve.fleet import Fleet


def cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return jetserve_cli(fleet, "routes", *args)


def jetserve_cli(fleet: Fleet, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Any admin-API command of ``jetserve``, with the fleet's admin URL and token."""
    env = {
        **os.environ,
        "JETSERVE_ADMIN_URL": fleet.admin_url,
        "JETSERVE_ADMIN_TOKEN": fleet.admin_token,
    }
    return subprocess.run(
        [sys.executable, "-m", "jetserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )

"""Reading Prometheus metrics the way an operator's scraper does: over HTTP,
from each process's own metrics port."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import httpx


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in an exposition ``text`` whose labels
    include ``labels`` (no labels: every sample)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def fleet_sum(urls: Iterable[str], name: str, **labels: str) -> float:
    """:func:`metric_sum` over every process that answers (a killed one does not)."""
    total = 0.0
    async with httpx.AsyncClient(timeout=5) as c:
        for url in urls:
            try:
                text = (await c.get(url)).text
            except httpx.TransportError:
                continue
            total += metric_sum(text, name, **labels)
    return total


def promtool() -> str:
    """promtool, on PATH or where `make test-setup` puts it: beside this venv's python."""
    beside = Path(sys.executable).parent / "promtool"
    found = shutil.which("promtool") or (str(beside) if beside.exists() else None)
    assert found, "promtool missing: run `make test-setup` (extracts it into .venv/bin)"
    return found


def promtool_check(text: str) -> None:
    """``promtool check metrics`` on an exposition: it must pass."""
    out = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr

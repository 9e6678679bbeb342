"""A test fleet's process logs (``--log-level info`` writes JSON lines): the
structured events (streams/logs.py) one process wrote."""

from __future__ import annotations

from typing import Any

import msgspec

from jetserve.fleet import Fleet


def events(fleet: Fleet, name: str) -> list[dict[str, Any]]:
    """Every event in ``name``'s log (``gateway0``, ``worker1``...), in order."""
    lines = (fleet.workdir / f"{name}.log").read_text().splitlines()
    # Every line is one JSON object: a line that is not fails the test.
    return [msgspec.json.decode(line) for line in lines if line.strip()]

"""`jetserve bench idle` on a real fleet: every process group measured, the
engine kept out of the fleet's own figure, the JSON written."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from jetserve.bench.cli import main
from jetserve.bench.idle import IdleResult

pytestmark = pytest.mark.connected


def test_bench_idle_writes_every_group_and_leaves_the_engine_out(tmp_path: Path) -> None:
    argv = ["idle", "--duration", "1", "--settle", "0", "--agents", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = msgspec.json.decode((tmp_path / "idle.json").read_bytes(), type=IdleResult)
    pct = res.percent_of_a_core
    assert set(pct) == {"gateway", "worker", "agent", "nats", "redis", "sim"}
    assert all(v >= 0 for v in pct.values())
    own = sum(v for k, v in pct.items() if k != "sim")
    assert res.fleet_percent == pytest.approx(own, abs=0.02)
    assert res.command.startswith("jetserve bench idle")

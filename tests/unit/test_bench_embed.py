"""`jetserve bench embed`'s figures: ratios against direct in the same round."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import msgspec
import pytest

from jetserve.bench.cli import build_parser
from jetserve.bench.cpu import keep_off, parse_cpu_list
from jetserve.bench.embed import Run, baseline_code, bodies, cpu_per_request, summarise


def run(arm: str, rnd: int, rate: float, inputs: int = 1) -> Run:
    return Run(
        arm=arm, inputs=inputs, round=rnd, requests=10, items=10 * inputs, errors=0,
        window_s=1.0, items_per_s=rate, p50_ms=10.0, p99_ms=20.0, cpu_s={},
    )  # fmt: skip


def test_ratios_are_taken_within_each_round() -> None:
    runs = [
        run("direct", 0, 100.0), run("jetserve", 0, 90.0),
        run("direct", 1, 50.0), run("jetserve", 1, 40.0),  # a noisy round: both fell
        run("direct", 2, 80.0), run("jetserve", 2, 76.0),
    ]  # fmt: skip
    got = summarise(runs, ["direct", "jetserve"], [1])["1"]
    assert got["direct"].ratio_to_direct == 1.0
    assert got["jetserve"].ratio_to_direct == 0.9  # median of 0.9, 0.8, 0.95
    assert got["jetserve"].ratio_min == 0.8
    assert got["jetserve"].items_per_s == 76.0


def test_bodies_carry_the_asked_inputs_and_the_command_parses() -> None:
    body = msgspec.json.decode(next(bodies("minilm", 8, seed=1)))
    assert len(body["input"]) == 8
    assert b'"input":"' in next(bodies("minilm", 1, seed=1))
    args = build_parser().parse_args(["embed", "--engine", "http://x:1", "--rounds", "1"])
    assert (args.command, args.rounds, args.engine) == ("embed", 1, "http://x:1")
    # The fleets run the product's durability unless asked otherwise.
    assert (args.nats_sync, args.redis_appendfsync, args.client) == ("always", "always", "lean")
    lazy = ["embed", "--nats-sync", "2m", "--redis-appendfsync", "everysec", "--client", "httpx"]
    args = build_parser().parse_args(lazy)
    assert (args.nats_sync, args.redis_appendfsync, args.client) == ("2m", "everysec", "httpx")


def test_cpu_per_request_counts_the_engine_and_the_arms_own_processes() -> None:
    cpu = {"engine": 0.2, "jetserve:gateway": 0.03, "jetserve:worker": 0.02, "jetserve:bus": 0.01}
    cpu |= {"other-arm:worker": 5.0, "other": 1.5}
    runs = [
        msgspec.structs.replace(run("jetserve", rnd, 100.0), requests=requests, cpu_s=cpu)
        for rnd, requests in enumerate((10, 20, 10))
    ]
    got = cpu_per_request(runs, "jetserve")
    # Medians of 20/10/20, 3/1.5/3, ...: another arm's fleet and the rest are not its own.
    assert got == {"engine": 20.0, "gateway": 3.0, "worker": 2.0, "bus": 1.0}
    summary = summarise([*runs, run("direct", 0, 100.0)], ["direct", "jetserve"], [1])["1"]
    assert summary["jetserve"].cpu_ms_per_request == got
    assert summary["jetserve"].other_cores == 1.5


def test_the_baseline_arm_runs_another_checkouts_code(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    (tmp_path / "jetserve").mkdir()
    (tmp_path / "jetserve" / "__init__.py").write_text("BASELINE = True\n")
    repo = pathlib.Path(__file__).resolve().parents[2]  # where the bench runs from
    probe = [sys.executable, "-c", "import jetserve; print(getattr(jetserve, 'BASELINE', False))"]
    with baseline_code(str(tmp_path)):
        # What a fleet started now runs: the other checkout's package, even from here.
        out = subprocess.run(probe, cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    assert os.environ["PYTHONPATH"] == "/elsewhere"
    assert "PYTHONSAFEPATH" not in os.environ
    out = subprocess.run(probe, cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    with pytest.raises(ValueError, match="no jetserve package"), baseline_code("/nonexistent"):
        pass


def test_cpu_lists_parse_as_taskset_writes_them() -> None:
    assert parse_cpu_list("1") == {1}
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list("one")


def test_the_path_keeps_off_the_engines_cpus() -> None:
    mine = os.sched_getaffinity(0)
    assert keep_off(None) is None
    assert keep_off("all") is None
    assert keep_off(",".join(map(str, mine))) is None  # nothing would be left: unpinned
    assert os.sched_getaffinity(0) == mine
    if len(mine) < 2:
        return
    engine = max(mine)
    try:
        assert keep_off(str(engine)) == sorted(mine - {engine})
        assert os.sched_getaffinity(0) == mine - {engine}
    finally:
        os.sched_setaffinity(0, mine)

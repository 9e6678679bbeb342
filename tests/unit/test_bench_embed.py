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
from jetserve.bench.embed import (
    Run,
    baseline_code,
    bodies,
    cpu_per_request,
    engine_steps,
    step_delta,
    summarise,
)


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
    assert args.max_inflight == 128  # the engine's max_num_seqs (bench/peers/vllm.sh)
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


# vLLM's histogram as two engine cores report it (label sets summed), beside a gauge.
METRICS = """\
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="minilm"} 5.0
vllm:iteration_tokens_total_count{engine="0",model_name="minilm"} 40.0
vllm:iteration_tokens_total_sum{engine="0",model_name="minilm"} 480.0
vllm:iteration_tokens_total_count{engine="1",model_name="minilm"} 10.0
vllm:iteration_tokens_total_sum{engine="1",model_name="minilm"} 120.0
vllm:num_requests_waiting{engine="0",model_name="minilm"} 3.0
"""


def test_the_engines_batch_is_read_from_its_step_histogram() -> None:
    assert engine_steps(METRICS) == (50.0, 600.0)
    assert engine_steps("vllm:num_requests_waiting 0.0\n") is None  # the simulator's
    assert step_delta((50.0, 600.0), (70.0, 1000.0)) == (20, 20.0)
    assert step_delta((50.0, 600.0), (50.0, 600.0)) == (None, None)  # no step between
    assert step_delta(None, (70.0, 1000.0)) == (None, None)
    runs = [
        Run(**{**msgspec.structs.asdict(run("jetserve", r, 90.0)), "tokens_per_step": t})
        for r, t in enumerate((20.0, 24.0, 30.0))
    ]
    assert summarise(runs, ["jetserve"], [1])["1"]["jetserve"].tokens_per_step == 24.0

"""Results, markdown, plots, the capacity plan, the progress bar and the CLI of
`jetserve bench`, on synthetic runs."""

from __future__ import annotations

import io
import math
import os
import time
from pathlib import Path

import pytest

from jetserve.bench import plots, sweep
from jetserve.bench.cli import main as bench_main
from jetserve.bench.cpu import CpuMeter, wait_quiet
from jetserve.bench.loadgen import Job, LoadResult
from jetserve.bench.metrics import added_latency, summarise
from jetserve.bench.plan import WARNING, capacity_plan, render
from jetserve.bench.progress import ProgressBar
from jetserve.bench.report import Results, build_results, load_results, write_json
from jetserve.bench.slo import parse_slo
from jetserve.bench.summary import markdown
from jetserve.bench.sweep import RunRecord, SweepConfig, run_salt
from jetserve.bench.targets import Target
from jetserve.bench.timeline import Timeline
from jetserve.cli import build_parser

SLO = parse_slo(["ttft=200ms"])


def timelines(rate: float, ttft: float, n: int = 50, tail: float = 0.0) -> list[Timeline]:
    """n requests at `rate`, each TTFT `ttft` (+ a slow tail on the last 10%)."""
    out = []
    for i in range(n):
        t = ttft + (tail if i >= n * 0.9 else 0.0) + i * 1e-5
        sent = i / rate
        chunks = [t, t + 0.02, t + 0.04]
        out.append(
            Timeline(
                index=i,
                cls="interactive",
                scheduled=sent,
                sent=sent,
                end=sent + chunks[-1],
                outcome="ok",
                status=200,
                ttft=t,
                chunks=chunks,
                e2e=chunks[-1],
                output_tokens=3,
            )
        )
    return out


def record(target: str, rate: float, ttft: float, tail: float = 0.0) -> RunRecord:
    tls = timelines(rate, ttft, tail=tail)
    return RunRecord(
        target=target,
        rate=rate,
        summary=summarise(target, rate, tls, slo=SLO),
        added=None,
        started_unix=0.0,
        clients=4,
        warmup_errors=[],
        timelines=tls,
    )


def results() -> Results:
    recs = []
    # direct holds the SLO through 8 req/s; the gateway adds 5 ms and fails at 8.
    for rate, base in ((2.0, 0.05), (4.0, 0.06), (8.0, 0.08)):
        d = record("direct", rate, base)
        g = record("gw", rate, base + 0.005, tail=0.5 if rate == 8.0 else 0.0)
        g.added = added_latency(g.summary, d.summary)
        recs += [d, g]
    return build_results(
        recs,
        targets=[{"name": "direct", "url": "http://d/v1"}, {"name": "gw", "url": "http://g/v1"}],
        baseline="direct",
        slo=SLO.describe(),
        slo_target=0.95,
        max_lag=0.025,
        workload={"classes": {"interactive": {"weight": 1, "input_len": "256", "output_len": "3"}}},
        meta={"command": "jetserve bench --fleet", "engine_replicas": 1},
    )


def test_results_capacity_and_headline() -> None:
    res = results()
    assert res.rates == [2.0, 4.0, 8.0]
    assert res.capacity["direct"].max_rate == 8.0
    assert res.capacity["direct"].all_held
    assert res.capacity["gw"].max_rate == 4.0
    assert not res.capacity["gw"].all_held
    (h,) = res.headline
    assert h.target == "gw"
    assert h.light_rate == 2.0
    assert h.held_rate == 8.0
    assert h.added_ttft_p50_light == pytest.approx(0.005)
    assert h.max_rate_under_slo == 4.0


def test_json_round_trip_and_markdown(tmp_path: Path) -> None:
    res = results()
    write_json(res, tmp_path / "results.json")
    back = load_results(tmp_path / "results.json")
    assert back == res
    assert b"chunks" not in (tmp_path / "results.json").read_bytes()  # no per-request data
    md = markdown(back, ["latency_vs_load.png"])
    assert "## Headline" in md
    assert "| gw | +5.0 / +5.0 |" in md
    assert "| direct | >= 8 (every rate held) |" in md
    assert "![latency_vs_load.png](latency_vs_load.png)" in md
    (tmp_path / "bad.json").write_text('{"schema": "other/1"}')
    with pytest.raises(ValueError, match="schema"):
        load_results(tmp_path / "bad.json")


def test_plots_are_written_and_small(tmp_path: Path) -> None:
    assert plots.available()
    names = plots.write_plots(results(), tmp_path)
    assert names == list(plots.FILES)
    for name in names:
        size = (tmp_path / name).stat().st_size
        assert 5_000 < size < 200_000, (name, size)


def test_capacity_plan() -> None:
    res = results()
    p = capacity_plan(res, target="gw", peak_rate=30.0, rho_max=0.8)
    x_sat = max(r.summary.request_throughput for r in res.runs if r.target == "gw")
    assert p.x_sat == pytest.approx(x_sat)
    assert p.replicas == 1
    assert p.e_s == pytest.approx(1 / x_sat)
    assert p.g_min == math.ceil(30.0 * (1 / x_sat) / 0.8)
    assert p.g_slo == math.ceil(30.0 / 4.0)
    assert not p.saturated  # the synthetic sweep never saturated
    assert p.notes
    text = render(p, "r.json")
    assert "g_min       = ceil(lambda_peak * E[S] / rho_max)" in text
    assert "lambda_peak = 30 req/s  (--peak-rate)" in text
    assert text.endswith(WARNING)
    assert capacity_plan(res).target == "gw"  # the non-baseline target by default
    with pytest.raises(ValueError, match="no target 'nope'"):
        capacity_plan(res, target="nope")
    with pytest.raises(ValueError, match="rho_max must be"):
        capacity_plan(res, rho_max=0)


def test_progress_bar_on_a_terminal_and_in_a_log() -> None:
    now = [0.0]
    tty = io.StringIO()
    bar = ProgressBar(100, tty, tty=True, width=10, clock=lambda: now[0])
    bar.start_run("direct @ 2 req/s", 50)
    now[0] = 10.0
    bar.update(30, 25, 1)
    assert (
        "[##........]  25% direct @ 2 req/s  sent 30/50 done 25 bad 1  10s (eta 30s)"
        in tty.getvalue()
    )
    bar.end_run()
    assert "\r\x1b[2K[#####.....]  50%" in tty.getvalue()
    log = io.StringIO()
    bar = ProgressBar(10, log, tty=False, clock=lambda: now[0])
    bar.start_run("x", 10)
    bar.update(1, 0, 0)  # within 5 s of the run start: not printed
    now[0] = 16.0
    bar.update(2, 1, 0)
    bar.end_run()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 2
    assert "sent 2/10 done 1 bad 0" in lines[0]
    assert "100% x  sent 10/10 done 10" in lines[1]
    quiet = io.StringIO()
    off = ProgressBar(10, quiet, enabled=False)
    off.start_run("x", 10)
    off.end_run()
    off.close()
    assert quiet.getvalue() == ""


def test_run_salts_differ_per_target_and_rate() -> None:
    salts = {run_salt(0, r, t) for r in (2.0, 4.0) for t in ("a", "b")}
    assert len(salts) == 4
    assert all(s.isalnum() for s in salts)


def test_cli_plan_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_json(results(), tmp_path / "results.json")
    assert (
        bench_main(["plan", "--results", str(tmp_path / "results.json"), "--peak-rate", "20"]) == 0
    )
    out = capsys.readouterr().out
    assert "capacity plan for target 'gw'" in out
    assert "g_min" in out
    assert "warning:" in out
    assert bench_main(["report", "--results", str(tmp_path / "results.json"), "--no-plots"]) == 0
    assert (tmp_path / "summary.md").read_text().startswith("# jetserve bench")
    assert bench_main(["plan", "--results", str(tmp_path / "results.json"), "--target", "x"]) == 2


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--rate", "2"],  # no target
        ["--target", "a=http://h", "--rate", "2", "--sweep", "2,4"],
        ["--target", "a=http://h"],  # no load
        ["--target", "a=http://h", "--rate", "0"],
        ["--target", "a=http://h", "--rate", "1", "--input-len", "zipf:1:2"],
    ):
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2
    assert "usage: jetserve bench" in capsys.readouterr().err


def test_jetserve_cli_hands_every_flag_to_bench() -> None:
    args = build_parser().parse_args(["bench", "--sweep", "2,4", "--target", "a=http://h", "-h"])
    assert args.cmd == "bench"
    assert args.bench_args == ["--sweep", "2,4", "--target", "a=http://h", "-h"]


def test_cpu_meter_counts_a_process_tree_and_the_rest_of_the_machine() -> None:
    meter = CpuMeter({"me": [os.getpid()], "gone": []})
    assert set(meter.groups) == {"me"}  # empty groups are dropped
    before = meter.sample()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    d = CpuMeter.delta(before, meter.sample())
    assert d["me"] >= 0.15
    assert "other" in d
    assert d["other"] >= 0.0
    assert set(CpuMeter({}).sample()) <= {"_machine", "_self"}  # no groups: machine only


def test_wait_quiet_returns_what_others_use() -> None:
    slept: list[float] = []
    cores = wait_quiet(CpuMeter({}), max_cores=64.0, timeout=0.0, window=0.01, sleep=slept.append)
    assert slept == [0.01]
    assert cores is not None
    assert cores >= 0.0


def test_a_run_disturbed_by_other_processes_is_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    others = iter([30.0, 0.2])  # CPU s others took: the first attempt was disturbed

    class FakeMeter:
        def __init__(self, groups: dict[str, list[int]]) -> None:
            pass

        def sample(self) -> dict[str, float]:
            return {}

        @staticmethod
        def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
            return {"other": next(others)}

    salts: list[str] = []

    def fake_run(job: Job, in_process: bool, on_progress: object) -> LoadResult:
        salts.append(job.salt)
        tls = timelines(10.0, 0.05, n=len(job.requests))
        return LoadResult(timelines=tls, started_unix=0.0, clients=1, warmup_errors=[], cpu_s=0.1)

    monkeypatch.setattr(sweep, "CpuMeter", FakeMeter)
    monkeypatch.setattr(sweep, "_run", fake_run)
    cfg = SweepConfig(rates=[10.0], count=20, cooldown=0, max_other=0.25, retries=2)
    bar = ProgressBar(20, io.StringIO(), enabled=False)
    (rec,) = sweep.run_sweep(cfg, [Target(name="a", url="http://a/v1")], progress=bar)
    assert rec.attempts == 2
    assert bar.total == 40
    assert rec.other_cores is not None
    assert rec.other_cores < 0.25
    assert rec.cpu == {"other": 0.2, "generator": 0.1}
    assert len(set(salts)) == 2  # the repeat must not meet the cache its first attempt warmed

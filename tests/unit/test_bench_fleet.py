"""The fleet bench's arithmetic: what a run summary says, and how it renders."""

from __future__ import annotations

from dataclasses import asdict

from jetserve.bench.fleet.client import Shot, summarize
from jetserve.bench.fleet.plots import _labels
from jetserve.bench.fleet.scenarios import render


def shots() -> list[Shot]:
    out = [
        Shot("interactive", 0.0, 200, f"r{i}", "ok", ttft=0.010 * (i + 1), e2e=0.5,
             prompt_tokens=100, cached_tokens=80)
        for i in range(10)
    ]  # fmt: skip
    out.append(Shot("interactive", 1.0, 429, None, "rejected", "deadline_unmeetable"))
    out.append(Shot("batch", 1.0, 504, "r99", "failed", "deadline_exceeded"))
    return out


def test_summary_puts_latency_beside_admission() -> None:
    s = summarize("run", shots(), duration=2.0)
    assert (s.offered, s.admitted, s.completed, s.rejected, s.failed, s.lost) == (
        12, 11, 10, 1, 1, 0,
    )  # fmt: skip
    assert s.admission_rate == round(11 / 12, 3)
    assert s.goodput_rps == 5.0
    # Nearest-rank percentiles over the completed requests only (10..100 ms).
    assert s.ttft_ms == {"p50": 50.0, "p90": 90.0, "p95": 100.0, "p99": 100.0}
    assert s.prefix_hit_rate == 0.8
    assert s.errors == {"deadline_unmeetable": 1, "deadline_exceeded": 1}


def test_render_and_plot_labels() -> None:
    rows = [asdict(summarize("half batch, shedding", shots(), 2.0))]
    rows.append(asdict(summarize("  batch", shots()[-1:], 2.0)))
    text = render({"scenario": "saturation", "setup": {"deadline_s": 4}, "rows": rows})
    assert "| half batch, shedding | 12 | 11 | 91.7% | 10 | 5.0 | 1 | 1 | 0 | 50.0 |" in text
    assert '"deadline_exceeded": 1' in text
    assert _labels(["half batch, shedding", "  batch", "round_robin"]) == [
        "half batch\nshedding",
        "half batch\nshedding\nbatch",
        "round robin",
    ]


def test_render_shows_the_rollout_figures() -> None:
    rows = [asdict(summarize("bad canary at 20%", shots(), 2.0))]
    found = {"rolled_back_after_s": 11.7, "canary_arm_failed": 24}
    slow = {"rolled_back_after_s": 9.1, "harmed": 30}
    result = {"scenario": "rollout", "setup": {}, "rollout": found, "rollout_slow": slow}
    text = render({**result, "rows": rows})
    assert 'rollout: `{"rolled_back_after_s": 11.7, "canary_arm_failed": 24}`' in text
    assert 'rollout_slow: `{"rolled_back_after_s": 9.1, "harmed": 30}`' in text

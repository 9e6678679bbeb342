"""PNG plots of a results file (matplotlib, the `bench` extra): latency percentiles vs
offered load per target, throughput and SLO attainment vs offered load, and TTFT
CDFs. Small figures at a modest DPI keep each file well under 200 KB."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from jetserve.bench.metrics import CDF_POINTS
from jetserve.bench.report import Results
from jetserve.bench.units import fmt_rate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis

DPI = 90
FILES = ("latency_vs_load.png", "throughput_vs_load.png", "ttft_cdf.png")


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(res: Results, out_dir: Path) -> list[str]:
    """Write the PNGs; return their file names (relative to out_dir)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    colors = {n: f"C{i}" for i, n in enumerate(res.target_names())}
    return [plot(res, out_dir, colors) for plot in (_latency, _throughput, _ttft_cdf)]


def _latency(res: Results, out_dir: Path, colors: dict[str, str]) -> str:
    from matplotlib.figure import Figure

    names = res.target_names()
    # Latency percentiles vs offered load.
    fig = Figure(figsize=(13, 3.8), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 3)
    panels = (
        ("ttft", "TTFT", "ttft_ms"),
        ("tpot", "TPOT", "tpot_ms"),
        ("e2e", "E2E latency", "e2e_ms"),
    )
    for ax, (key, title, slo_key) in zip(axes, panels, strict=True):
        for name in names:
            runs = [r for r in res.runs if r.target == name]
            rates = [r.rate for r in runs]
            for pct, style in (("p50", "-"), ("p99", "--")):
                vals = [_ms(getattr(r.summary.latency, key).get(pct)) for r in runs]
                ax.plot(
                    rates, vals, style, marker="o", ms=3, color=colors[name], label=f"{name} {pct}"
                )
        if slo_key in res.slo:
            ax.axhline(res.slo[slo_key], color="grey", ls=":", lw=1, label="SLO")
        _style(ax, title + " (ms)", log=key != "tpot")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Latency vs offered load (solid p50, dashed p99)", fontsize=10)
    return _save(fig, out_dir, FILES[0])


def _throughput(res: Results, out_dir: Path, colors: dict[str, str]) -> str:
    from matplotlib.figure import Figure

    names = res.target_names()
    # Throughput, goodput and SLO attainment vs offered load.
    fig = Figure(figsize=(10, 3.6), dpi=DPI, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    top = max(res.rates) if res.rates else 1.0
    ax1.plot([0, top], [0, top], color="grey", ls=":", lw=1, label="offered")
    for name in names:
        runs = [r for r in res.runs if r.target == name]
        rates = [r.rate for r in runs]
        ax1.plot(
            rates,
            [r.summary.request_throughput for r in runs],
            "-",
            marker="o",
            ms=3,
            color=colors[name],
            label=f"{name} completed",
        )
        ax1.plot(
            rates,
            [r.summary.slo.goodput for r in runs],
            "--",
            marker="x",
            ms=3,
            color=colors[name],
            label=f"{name} goodput",
        )
        att = [r.summary.slo.attainment for r in runs]
        ax2.plot(
            rates,
            [100 * a if a is not None else float("nan") for a in att],
            "-",
            marker="o",
            ms=3,
            color=colors[name],
            label=name,
        )
    ax2.axhline(100 * res.slo_target, color="grey", ls=":", lw=1, label="target")
    _style(ax1, "requests / s", log=False)
    _style(ax2, "SLO attainment (%)", log=False)
    ax2.set_ylim(0, 105)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle("Throughput and SLO attainment vs offered load", fontsize=10)
    return _save(fig, out_dir, FILES[1])


def _ttft_cdf(res: Results, out_dir: Path, colors: dict[str, str]) -> str:
    from matplotlib.figure import Figure

    names = res.target_names()
    # TTFT CDFs, one panel per offered load.
    n = len(res.rates)
    cols = min(n, 3) or 1
    rows = (n + cols - 1) // cols or 1
    fig = Figure(figsize=(4.3 * cols, 3.0 * rows), dpi=DPI, layout="constrained")
    grid = fig.subplots(rows, cols, squeeze=False)
    ys = [100 * i / (CDF_POINTS - 1) for i in range(CDF_POINTS)]
    for i, rate in enumerate(res.rates):
        ax = grid[i // cols][i % cols]
        for name in names:
            e = res.run(name, rate)
            if e is None or not e.summary.ttft_quantiles:
                continue
            ax.plot(
                [1000 * q for q in e.summary.ttft_quantiles], ys, color=colors[name], label=name
            )
        if "ttft_ms" in res.slo:
            ax.axvline(res.slo["ttft_ms"], color="grey", ls=":", lw=1)
        ax.set_xscale("log")
        _plain(ax.xaxis)
        ax.set_title(f"{fmt_rate(rate)} req/s", fontsize=9)
        ax.set_xlabel("TTFT (ms)", fontsize=8)
        ax.set_ylabel("% of requests", fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(True, alpha=0.3)
    for j in range(n, rows * cols):
        grid[j // cols][j % cols].set_visible(False)
    grid[0][0].legend(fontsize=7)
    fig.suptitle("TTFT CDF by offered load", fontsize=10)
    return _save(fig, out_dir, FILES[2])


def _ms(v: float | None) -> float:
    return float("nan") if v is None else v * 1000


def _tick(v: float, _pos: object = None) -> str:
    """Label 1, 2 and 5 times a power of ten, plainly (200, not 2x10^2); leave the
    other minor ticks unlabelled so they do not run into each other."""
    if v <= 0:
        return ""
    mantissa = v / 10 ** math.floor(math.log10(v) + 1e-9)
    return f"{v:g}" if round(mantissa, 6) in (1.0, 2.0, 5.0) else ""


def _plain(axis: Axis) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(_tick))
    axis.set_minor_formatter(FuncFormatter(_tick))


def _style(ax: Axes, ylabel: str, *, log: bool) -> None:
    ax.set_xlabel("offered load (req/s)", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    if log:
        ax.set_yscale("log")
        _plain(ax.yaxis)
    ax.tick_params(which="both", labelsize=7)
    ax.grid(True, alpha=0.3)


def _save(fig: object, out_dir: Path, name: str) -> str:
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure)
    fig.savefig(out_dir / name, dpi=DPI)
    return name

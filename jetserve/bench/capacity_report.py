"""The output of `jetserve bench capacity`: results.json, summary.md and two plots
(``cpu_per_request.png``, ``latency_vs_load.png``; matplotlib, as ``plots.py``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jetserve.bench import plots
from jetserve.bench.capacity_stats import COMPONENTS, CapacityResults, Level, encode, highest

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PLOTS = ("cpu_per_request.png", "latency_vs_load.png")
GENERATOR_WARN_CORES = 0.8  # above this the generator may be what limits the rate
OTHER_WARN_CORES = 0.25  # above this the machine was busy with something else


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def used_components(res: CapacityResults) -> list[str]:
    seen = {c for lv in res.levels for c in lv.components}
    return [c for c in COMPONENTS if c in seen] + sorted(seen - set(COMPONENTS))


def table(res: CapacityResults) -> list[str]:
    stream = any(lv.ttft is not None for lv in res.levels)
    comps = used_components(res)
    head = ["target", "C", "req/s", "p50 ms", "p99 ms", "p99/p50"]
    head += ["TTFT p50", "TTFT p99"] if stream else []
    head += ["errors", *comps, "total", "generator cores", "other cores"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in res.levels:
        row = [lv.target, str(lv.concurrency), f"{lv.req_per_s:.1f}", _ms(lv.e2e.p50),
               _ms(lv.e2e.p99), _num(lv.p99_over_p50, ".2f")]  # fmt: skip
        if stream:
            ttft = lv.ttft
            row += [_ms(ttft.p50 if ttft else None), _ms(ttft.p99 if ttft else None)]
        row.append(str(lv.errors))
        row += [_num(lv.cpu_ms_per_request.get(c), ".2f") for c in comps]
        row += [_num(lv.cpu_ms_total, ".2f"), _num(lv.generator_cores, ".2f")]
        row.append(_num(lv.other_cores, ".2f"))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def warnings(res: CapacityResults) -> list[str]:
    out: list[str] = []
    max_tokens = res.config.get("max_tokens")
    for lv in res.levels:
        where = f"{lv.target} C={lv.concurrency}"
        if lv.generator_cores is not None and lv.generator_cores > GENERATOR_WARN_CORES:
            out.append(
                f"{where}: the load generator used {lv.generator_cores:.2f} cores: it may be "
                "what limits the rate"
            )
        if lv.other_cores is not None and lv.other_cores > OTHER_WARN_CORES:
            out.append(f"{where}: processes outside the benchmark took {lv.other_cores:.2f} cores")
        if lv.errors:
            kinds = ", ".join(f"{k} x{n}" for k, n in sorted(lv.error_kinds.items()))
            out.append(f"{where}: {lv.errors} failed requests ({kinds})")
        if lv.failed_after_window:
            out.append(
                f"{where}: {lv.failed_after_window} requests open when the window closed "
                "failed or hung afterwards (a hung one held a client for part of the window)"
            )
        if lv.completed == 0:
            out.append(f"{where}: no request completed inside the window")
        span = (lv.output_tokens.get("min"), lv.output_tokens.get("max"))
        if res.config.get("ignore_eos") and lv.output_tokens and span != (max_tokens, max_tokens):
            out.append(f"{where}: outputs of {span[0]}..{span[1]} tokens, not {max_tokens}")
    return out


def _describe(res: CapacityResults) -> list[str]:
    m, c = res.meta, res.config
    machine = m.get("machine")
    mach = machine if isinstance(machine, dict) else {}
    lite = m.get("litellm")
    peer = f"LiteLLM {lite.get('version')}" if isinstance(lite, dict) else "LiteLLM not used"
    mode = "streaming" if c.get("stream") else "non-streaming"
    eos = " (ignore_eos)" if c.get("ignore_eos") else ""
    engine = (
        f"engine {c['engine']} (its CPU not counted)" if c.get("engine") else
        f"simulator `{c.get('profile')}`"
    )  # fmt: skip
    shared = " on one port (SO_REUSEPORT)" if c.get("share_port") else ""
    raw_levels = c.get("levels")
    levels = ", ".join(str(v) for v in raw_levels) if isinstance(raw_levels, list) else "-"
    return [
        f"`{m.get('command', '')}`",
        "",
        f"- machine: {mach.get('arch')}, {mach.get('cores')} cores "
        f"({mach.get('usable_cores')} usable), Python {mach.get('python')}; "
        f"git {m.get('git') or '-'}; {m.get('when', '')}",
        f"- fleet: {engine}, {c.get('workers')} workers, "
        f"{c.get('gateways')} gateway(s){shared}; {peer}",
        f"- load: closed loop at concurrency {levels}; {c.get('duration')} s measured per "
        f"level after {c.get('warmup')} s of warm-up; {mode} `{c.get('api')}`, "
        f"{c.get('input_tokens')} prompt tokens, {c.get('max_tokens')} output tokens{eos}",
    ]


def markdown(res: CapacityResults, plot_names: Sequence[str] = ()) -> str:
    lines = ["# jetserve bench capacity", "", *_describe(res), "", "## Per target and level", ""]
    lines += [
        "Latency is end to end (ms) over the requests that completed inside the window. "
        "The component columns are CPU-ms per completed request (`-`: not on that "
        "target's path); `total` is their sum. `generator` and `other` are the cores the "
        "load generator and processes outside the benchmark used during the window.",
        "",
        *table(res),
        "",
        "## Max rate",
        "",
        "| target | max req/s | at C | CPU-ms/request there | p99/p50 at the highest C |",
        "|---|---|---|---|---|",
    ]
    for name in res.target_names():
        mr = res.max_rate.get(name)
        tail = _num(res.tail_at_highest.get(name), ".2f")
        if mr is not None:
            lines.append(
                f"| {name} | {mr.req_per_s:.1f} | {mr.concurrency} | "
                f"{_num(mr.cpu_ms_total, '.2f')} | {tail} |"
            )
    lines += ["", "Ratios of max req/s, same run:", ""]
    for key, value in res.ratios.items():
        text = f"{value:.2f}x" if value is not None else "not measured (a target missing)"
        lines.append(f"- {key}: {text}")
    warn = warnings(res)
    if warn:
        lines += ["", "## Warnings", "", *(f"- {w}" for w in warn)]
    if plot_names:
        lines += ["", "## Plots", "", *(f"![{n}]({n})" for n in plot_names)]
    return "\n".join(lines) + "\n"


def write_plots(res: CapacityResults, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    return [_cpu_plot(res, out), _latency_plot(res, out)]


def _cpu_plot(res: CapacityResults, out: Path) -> str:
    from matplotlib.figure import Figure

    top = highest(res.levels)
    names = res.target_names()
    fig = Figure(figsize=(6.5, 3.8), dpi=plots.DPI, layout="constrained")
    ax = fig.subplots()
    bottoms = [0.0] * len(names)
    for i, comp in enumerate(used_components(res)):
        vals = [top[n].cpu_ms_per_request.get(comp, 0.0) for n in names]
        ax.bar(names, vals, bottom=bottoms, color=f"C{i}", label=comp)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for x, (n, b) in enumerate(zip(names, bottoms, strict=True)):
        ax.annotate(f"{b:.2f} @ C={top[n].concurrency}", (x, b), ha="center", va="bottom",
                    fontsize=7)  # fmt: skip
    ax.set_ylabel("CPU-ms per request", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("CPU per request by component, at each target's highest level", fontsize=10)
    fig.savefig(out / PLOTS[0], dpi=plots.DPI)
    return PLOTS[0]


def _latency_plot(res: CapacityResults, out: Path) -> str:
    from matplotlib.figure import Figure

    stream = any(lv.ttft is not None for lv in res.levels)
    fig = Figure(figsize=(10 if stream else 5.5, 3.8), dpi=plots.DPI, layout="constrained")
    axes = fig.subplots(1, 2 if stream else 1, squeeze=False)[0]
    panels: list[tuple[Axes, str]] = [(axes[0], "E2E latency (ms)")]
    if stream:
        panels.append((axes[1], "TTFT (ms)"))
    for ax, title in panels:
        for i, name in enumerate(res.target_names()):
            lvs = [lv for lv in res.levels if lv.target == name]
            for pct, style in (("p50", "-"), ("p99", "--")):
                ys = [_stat_ms(lv, title, pct) for lv in lvs]
                ax.plot([lv.req_per_s for lv in lvs], ys, style, marker="o", ms=3,
                        color=f"C{i}", label=f"{name} {pct}")  # fmt: skip
            for lv in lvs:
                ax.annotate(f"C={lv.concurrency}", (lv.req_per_s, _stat_ms(lv, title, "p50")),
                            fontsize=6, xytext=(2, 2), textcoords="offset points")  # fmt: skip
        ax.set_xlabel("achieved load (req/s)", fontsize=8)
        ax.set_ylabel(title, fontsize=8)
        ax.set_yscale("log")
        plots._plain(ax.yaxis)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Latency vs achieved load, closed loop (solid p50, dashed p99)", fontsize=10)
    fig.savefig(out / PLOTS[1], dpi=plots.DPI)
    return PLOTS[1]


def _stat_ms(lv: Level, title: str, pct: str) -> float:
    s = lv.ttft if title.startswith("TTFT") else lv.e2e
    v = s.get(pct) if s is not None else None
    return float("nan") if v is None else v * 1000


def write_outputs(res: CapacityResults, out: Path, *, plots_wanted: bool = True) -> list[str]:
    """Write results.json, the plots and summary.md; return the lines to print."""
    (out / "results.json").write_bytes(encode(res))
    names: list[str] = []
    if plots_wanted and plots.available():
        names = write_plots(res, out)
    elif plots_wanted:
        print("jetserve bench: matplotlib missing (pip install 'jetserve[bench]'): no plots",
              file=sys.stderr)  # fmt: skip
    (out / "summary.md").write_text(markdown(res, names))
    lines = [f"results: {out / 'results.json'}", f"summary: {out / 'summary.md'}"]
    for name, mr in res.max_rate.items():
        lines.append(f"  {name}: max {mr.req_per_s:.1f} req/s (at C={mr.concurrency})")
    for key, value in res.ratios.items():
        lines.append(f"  {key}: " + (f"{value:.2f}x" if value is not None else "not measured"))
    lines += [f"  WARNING: {w}" for w in warnings(res)]
    return lines

"""PNG plots of the fleet scenarios (matplotlib, the `bench` extra): one small
figure per scenario, from its results JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 90


def write_fleet_plots(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    from matplotlib.figure import Figure

    written = []
    for name, result in results.items():
        rows = result["rows"]
        fig = Figure(figsize=(max(8, 1.3 * len(rows)), 3.6), dpi=DPI)
        left, right = fig.subplots(1, 2)
        labels = _labels([r["name"] for r in rows])
        x = range(len(rows))
        for i, q in enumerate(("p50", "p90", "p99")):
            vals = [r["ttft_ms"][q] or 0 for r in rows]
            left.bar([v + (i - 1) * 0.27 for v in x], vals, width=0.27, label=f"TTFT {q}")
        left.set_xticks(list(x), labels, fontsize=6)
        left.set_ylabel("ms")
        left.legend(fontsize=7)
        left.set_title(f"{name}: first-token latency", fontsize=9)
        if name in ("soak", "scale", "kvindex"):
            if name == "soak":
                _rss(right, result.get("rss_samples", []))
            else:
                _hits(right, result)
            fig.tight_layout()
            fig.savefig(out / f"{name}.png")
            written.append(f"{name}.png")
            continue
        if name == "affinity":
            right.bar(list(x), [100 * (r["prefix_hit_rate"] or 0) for r in rows], color="C2")
            right.set_ylabel("prefix-cache hit rate (%)")
        else:
            right.bar(list(x), [r["goodput_rps"] for r in rows], color="C2", label="goodput/s")
            right.plot(
                list(x),
                [r["admission_rate"] * max(1, max(r2["goodput_rps"] for r2 in rows)) for r in rows],
                "ko",
                label="admission rate (scaled)",
            )
            right.set_ylabel("completed per second")
            right.legend(fontsize=7)
        right.set_xticks(list(x), labels, fontsize=6)
        right.set_title(
            f"{name}: " + ("cache hits" if name == "affinity" else "goodput"), fontsize=9
        )
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        written.append(path.name)
    return written


def _rss(ax: Any, samples: list[dict[str, Any]]) -> None:
    """RSS of each process over the run: it should stay flat."""
    names = [k for k in (samples[0] if samples else {}) if k != "t_s"]
    for name in names:
        ax.plot([s["t_s"] for s in samples], [s[name] or 0 for s in samples], label=name)
    ax.set_xlabel("s")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.set_title("soak: memory over the run", fontsize=9)


def _hits(ax: Any, result: dict[str, Any]) -> None:
    """The hit share of what was sent, window by window, with the scale changes."""
    for mode, series in result.get("hit_series", {}).items():
        ax.plot([t for t, _ in series], [100 * h for _, h in series], label=mode.replace("_", " "))
    for change in result.get("changes", []):
        ax.axvline(change["at_s"], color="grey", linestyle=":", linewidth=1)
        ax.annotate(change["change"], (change["at_s"], 2), fontsize=6, rotation=90)
    ax.set_xlabel("s (send time)")
    ax.set_ylabel("prefix-cache hit share (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7)
    ax.set_title(f"{result.get('scenario', 'scale')}: cache hits over the run", fontsize=9)


def _labels(names: list[str]) -> list[str]:
    """Short tick labels: a sub-row ("  batch") under its run, one term a line."""
    out, parent = [], ""
    for name in names:
        if name.startswith(" "):
            name = f"{parent}: {name.strip()}"
        else:
            parent = name
        out.append(name.replace(", ", "\n").replace(": ", "\n").replace("_", " "))
    return out

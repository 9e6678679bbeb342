"""The markdown summary (``summary.md``) of a results file: one section per view,
latencies in ms with vLLM's definitions (docs/bench.md)."""

from __future__ import annotations

from typing import Any

from jetserve.bench.metrics import Capacity, Stat
from jetserve.bench.report import Results
from jetserve.bench.units import fmt_ms, fmt_rate

_DELTA_KEYS = ("mean", "p50", "p95", "p99")
_CPU_ORDER = ("engine", "gateway", "workers", "nats", "redis", "litellm", "generator", "other")


def markdown(res: Results, plots: list[str] | None = None) -> str:
    lines = _header(res)
    lines += _headline_section(res)
    lines += _capacity_section(res)
    lines += _results_section(res)
    lines += _added_section(res)
    lines += _class_section(res)
    lines += _generator_section(res)
    lines += _cpu_section(res)
    lines += _failures_section(res)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


# -- cells -------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return fmt_ms(v)


def _signed_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:+.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def _stat_cols(s: Stat, keys: tuple[str, ...]) -> list[str]:
    return [_ms(s.get(k)) for k in keys]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _cap_text(cap: Capacity) -> str:
    if cap.max_rate is None:
        return "none (failed at the lowest rate)"
    return (
        f">= {fmt_rate(cap.max_rate)} (every rate held)" if cap.all_held else fmt_rate(cap.max_rate)
    )


# -- sections ----------------------------------------------------------------


def _header(res: Results) -> list[str]:
    m = res.meta
    lines = [f"# {m.get('title') or 'jetserve bench'}", ""]
    lines.append(
        f"{m.get('when', '')} on {m.get('machine', '?')}. Command: `{m.get('command', '')}`"
    )
    lines.append("")
    lines.append(f"- Workload: {_workload_text(res.workload)}")
    slo = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in res.slo.items()) or "none (success rate)"
    lines.append(f"- SLO: {slo}; attainment target {res.slo_target * 100:g}%")
    names = ", ".join(f"{t['name']} ({t['url']})" for t in res.targets)
    lines.append(f"- Targets: {names}" + (f"; baseline `{res.baseline}`" if res.baseline else ""))
    if m.get("mode") == "fleet":
        lines.append(f"- Fleet: {_fleet_text(m)}")
    lines.append(
        f"- Each point: {m.get('point', '')}; the generator flags a run whose p99 send lag "
        f"exceeds {res.max_lag_ms:g} ms"
    )
    lines.append("")
    return lines


def _headline_section(res: Results) -> list[str]:
    if not res.headline:
        return []
    lines = ["## Headline", ""]
    rows = []
    for h in res.headline:
        rows.append(
            [
                h.target,
                f"{_signed_ms(h.added_ttft_p50_light)} / {_signed_ms(h.added_ttft_p99_light)}",
                f"{_signed_ms(h.added_ttft_p50_held)} / {_signed_ms(h.added_ttft_p99_held)}",
                _cap_text(res.capacity[h.target]),
            ]
        )
    base_cap = res.capacity.get(res.baseline or "")
    h0 = res.headline[0]
    head = [
        "target",
        f"added TTFT p50 / p99 (ms) @ {fmt_rate(h0.light_rate)} req/s",
        f"added TTFT p50 / p99 (ms) @ {fmt_rate(h0.held_rate or 0)} req/s",
        "max rate under SLO (req/s)",
    ]
    if h0.held_rate is None or h0.held_rate == h0.light_rate:
        head.pop(2)  # the baseline held only the lowest rate (or none): one column
        rows = [r[:2] + r[3:] for r in rows]
    lines += _table(head, rows)
    if base_cap is not None:
        lines += ["", f"Baseline `{res.baseline}` sustains: {_cap_text(base_cap)} req/s."]
    lines.append("")
    return lines


def _capacity_section(res: Results) -> list[str]:
    lines = ["## Max rate under the SLO", ""]
    lines += [
        f"The highest offered rate whose SLO attainment is at least "
        f"{res.slo_target * 100:g}% with every lower rate holding too; then the highest "
        "rate that held at all (a lower one may have dipped).",
        "",
    ]
    rows = []
    for name in res.target_names():
        cap = res.capacity[name]
        att = ", ".join(f"{r}: {_pct(a)}" for r, a in cap.attainment.items())
        high = "-" if cap.highest_held is None else fmt_rate(cap.highest_held)
        rows.append([name, _cap_text(cap), high, att])
    return lines + _table(
        ["target", "max rate (req/s)", "highest rate held", "SLO attainment by offered rate"],
        rows,
    )


_RESULTS_HEAD = [
    "req/s", "target", "sent", "ok", "rej/tmo/err/cxl", "done/s", "tok/s",
    "TTFT p50", "p95", "p99", "TPOT p50", "p99", "ITL p50", "p99", "E2E p50", "p99",
    "SLO", "goodput/s", "cached", "lag p99",
]  # fmt: skip


def _results_section(res: Results) -> list[str]:
    rows = []
    for rate in res.rates:
        for name in res.target_names():
            e = res.run(name, rate)
            if e is None:
                continue
            s = e.summary
            c = s.counts
            lat = s.latency
            rows.append(
                [
                    fmt_rate(rate),
                    name,
                    str(c.sent),
                    str(c.ok),
                    f"{c.rejected}/{c.timeout}/{c.error}/{c.cancelled}",
                    f"{s.request_throughput:.2f}",
                    f"{s.output_throughput:.0f}",
                    *_stat_cols(lat.ttft, ("p50", "p95", "p99")),
                    *_stat_cols(lat.tpot, ("p50", "p99")),
                    *_stat_cols(lat.itl, ("p50", "p99")),
                    *_stat_cols(lat.e2e, ("p50", "p99")),
                    _pct(s.slo.attainment),
                    f"{s.slo.goodput:.2f}",
                    _pct(s.cached_token_share),
                    _ms(s.generator.lag.p99) + (" (behind)" if s.generator.behind else ""),
                ]
            )
    return [
        "",
        "## Results by offered load",
        "",
        *_table(_RESULTS_HEAD, rows),
        "",
        "Latencies in ms over completed requests; vLLM's definitions (docs/bench.md). "
        "*rej/tmo/err/cxl*: rejected (429/503), timed out, failed, cancelled by the "
        "workload. *cached*: prompt tokens the engine served from its prefix cache.",
    ]


def _added_section(res: Results) -> list[str]:
    added = [e for e in res.runs if e.added is not None]
    if not added:
        return []
    rows = []
    for rate in res.rates:
        for e in added:
            if e.rate != rate or e.added is None:
                continue
            a = e.added
            rows.append(
                [
                    fmt_rate(rate),
                    e.target,
                    *(_signed_ms(a.ttft.get(k)) for k in _DELTA_KEYS),
                    *(_signed_ms(a.e2e.get(k)) for k in _DELTA_KEYS),
                ]
            )
    head = ["req/s", "target", "TTFT mean", "p50", "p95", "p99", "E2E mean", "p50", "p95", "p99"]
    return ["", f"## Added latency vs `{res.baseline}` (ms)", "", *_table(head, rows)]


_CLASS_HEAD = [
    "req/s", "target", "class", "sent", "ok", "TTFT mean", "p50", "p95", "p99",
    "TPOT p50", "p99", "E2E p50", "p99", "SLO",
]  # fmt: skip


def _class_section(res: Results) -> list[str]:
    classes = sorted({c for e in res.runs for c in e.summary.per_class})
    if len(classes) <= 1:
        return []
    rows = []
    for rate in res.rates:
        for name in res.target_names():
            e = res.run(name, rate)
            if e is None:
                continue
            for cls, cs in e.summary.per_class.items():
                rows.append(
                    [
                        fmt_rate(rate),
                        name,
                        cls,
                        str(cs.counts.sent),
                        str(cs.counts.ok),
                        *_stat_cols(cs.latency.ttft, ("mean", "p50", "p95", "p99")),
                        *_stat_cols(cs.latency.tpot, ("p50", "p99")),
                        *_stat_cols(cs.latency.e2e, ("p50", "p99")),
                        _pct(cs.slo.attainment),
                    ]
                )
    return ["", "## By request class", "", *_table(_CLASS_HEAD, rows)]


def _generator_section(res: Results) -> list[str]:
    rows = []
    for e in res.runs:
        g = e.summary.generator
        rows.append(
            [
                fmt_rate(e.rate),
                e.target,
                *_stat_cols(g.lag, ("p50", "p95", "p99", "max")),
                f"{g.scheduled_rate:.2f} / {g.achieved_rate:.2f}",
                str(e.clients),
                "BEHIND" if g.behind else "ok",
            ]
        )
    head = [
        "req/s", "target", "lag p50", "p95", "p99", "max", "scheduled / sent req/s",
        "http clients", "check",
    ]  # fmt: skip
    return ["", "## Load generator", "", *_table(head, rows)]


def _failures_section(res: Results) -> list[str]:
    lines: list[str] = []
    errs = [(e, k, v) for e in res.runs for k, v in e.summary.errors.items()]
    if errs:
        lines += ["", "## Failures", ""]
        lines += _table(
            ["req/s", "target", "what", "count"],
            [[fmt_rate(e.rate), e.target, f"`{k}`", str(v)] for e, k, v in errs],
        )
    short = [e for e in res.runs if e.summary.short_outputs]
    if short:
        lines += [
            "",
            "Some completed requests had fewer output tokens than asked (the target may "
            "ignore `ignore_eos`): "
            + ", ".join(f"{e.target}@{fmt_rate(e.rate)}: {e.summary.short_outputs}" for e in short),
        ]
    return lines


def _cpu_section(res: Results) -> list[str]:
    groups = [g for g in _CPU_ORDER if any(g in e.cpu for e in res.runs)]
    if not groups:
        return []
    paths: dict[str, list[str]] = res.meta.get("cpu_path") or {}
    rows = []
    for e in res.runs:
        path = paths.get(e.target)
        ok = e.summary.counts.ok
        per_req = f"{1000 * sum(e.cpu.get(g, 0.0) for g in path) / ok:.1f}" if path and ok else "-"
        gen = e.cpu.get("generator")
        gen_pct = (
            f"{100 * gen / e.summary.duration_s:.0f}%" if gen and e.summary.duration_s else "-"
        )
        rows.append(
            [
                fmt_rate(e.rate),
                e.target,
                *(f"{e.cpu[g]:.1f}" if g in e.cpu else "-" for g in groups),
                per_req,
                gen_pct,
                "-" if e.other_cores is None else f"{e.other_cores:.2f}",
                str(e.attempts),
            ]
        )
    lines = [
        "",
        "## CPU time during each run (s)",
        "",
        "Every process of the fleet shares this machine's cores. *Path ms/req*: CPU "
        "spent by the target's own processes (jetserve: gateway, workers, NATS, Redis; "
        "LiteLLM: its proxy) per completed request. *Generator*: the load generator's "
        "CPU use over the run. *other*: CPU taken by processes outside the benchmark "
        "(a busy machine skews every figure); *other cores*: the same, on average over "
        "the run. *Attempts*: runs repeated because others took too much (`--max-other`); "
        "the least disturbed attempt is kept.",
        "",
    ]
    head = ["req/s", "target", *groups, "path ms/req", "generator CPU", "other cores", "attempts"]
    return lines + _table(head, rows)


def _fleet_text(m: dict[str, Any]) -> str:
    peer = m.get("litellm")
    if isinstance(peer, dict):
        peer_text = (
            f"LiteLLM {peer.get('version', '?')} ({peer.get('provider', '?')}, "
            f"{peer.get('workers', '?')} worker)"
        )
    else:
        peer_text = "no LiteLLM"
    engine = m.get("engine")
    engine_text = (
        f"engine {engine}" if engine not in (None, "simulator") else
        f"simulator profile {m.get('profile')}"
    )  # fmt: skip
    shared = " on one port" if m.get("gateways_share_port") else ""
    return (
        f"{engine_text}, {m.get('workers')} workers, "
        f"{m.get('gateways')} gateway(s){shared}, {peer_text}"
    )


def _workload_text(wl: dict[str, Any]) -> str:
    if wl.get("trace"):
        return f"trace {wl['trace']} ({wl.get('requests', '?')} requests)"
    classes = wl.get("classes", {})
    parts = [
        f"{name} {c['weight']:g} (in {c['input_len']}, out {c['output_len']})"
        for name, c in classes.items()
    ]
    text = "arrivals " + (
        "Poisson" if wl.get("burstiness", 1.0) == 1.0 else f"gamma, burstiness {wl['burstiness']:g}"
    )
    text += "; classes " + "; ".join(parts)
    if wl.get("prefix_groups") and wl.get("prefix_share"):
        text += (
            f"; {wl['prefix_share'] * 100:g}% in {wl['prefix_groups']} shared-prefix groups "
            f"of {wl['prefix_len']} tokens"
        )
    if wl.get("cancel_rate"):
        text += f"; {wl['cancel_rate'] * 100:g}% cancelled after {wl['cancel_after_s']} s"
    return text + f"; seed {wl.get('seed', 0)}"

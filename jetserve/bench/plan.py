"""`jetserve bench plan`: how many engine replicas a peak load needs, from a run.

    g_min = ceil(lambda_peak * E[S] / rho_max)

E[S] is the replica-time one request takes, measured at saturation: a replica
that completes at most X_sat requests per second spends 1/X_sat seconds of itself
on each, so with g replicas behind the target E[S] = g / X_sat. rho_max is the
utilisation the fleet may run at (headroom for bursts). The formula is a mean-value
estimate: it says nothing about tail latency, which is why the plan also prints the
rate the open-loop sweep showed the SLO holds at, and warns that the sweep, not the
formula, is the proof.
"""

from __future__ import annotations

import math

import msgspec

from jetserve.bench.report import Results
from jetserve.bench.units import fmt_rate

WARNING = (
    "warning: g_min is a mean-value estimate. It ignores queueing tails, bursts and "
    "prefix-cache effects; the open-loop sweep (latency vs offered load, SLO attainment), "
    "not this formula, is the proof. Run the sweep at the planned size before relying on it."
)


class PlanResult(msgspec.Struct, kw_only=True):
    target: str
    lambda_peak: float
    lambda_source: str
    x_sat: float
    x_sat_offered: float
    replicas: int
    replicas_source: str
    e_s: float
    rho_max: float
    g_min: int
    saturated: bool
    slo_rate_per_replica: float | None
    g_slo: int | None
    notes: list[str]


def choose_target(res: Results, target: str | None) -> str:
    names = res.target_names()
    if target is not None:
        if target not in names:
            raise ValueError(f"no target {target!r} in the results (have: {', '.join(names)})")
        return target
    if "jetserve" in names:
        return "jetserve"
    others = [n for n in names if n != res.baseline]
    if not (others or names):
        raise ValueError("the results hold no targets")
    return (others or names)[0]


def capacity_plan(
    res: Results,
    *,
    target: str | None = None,
    peak_rate: float | None = None,
    rho_max: float = 0.8,
    replicas: int | None = None,
) -> PlanResult:
    if not 0 < rho_max <= 1:
        raise ValueError("rho_max must be in (0, 1]")
    name = choose_target(res, target)
    runs = [r for r in res.runs if r.target == name]
    if not runs:
        raise ValueError(f"no runs for target {name!r}")
    best = max(runs, key=lambda r: r.summary.request_throughput)
    x_sat = best.summary.request_throughput
    if x_sat <= 0:
        raise ValueError(f"target {name!r} completed no requests: nothing to plan from")
    notes: list[str] = []
    if replicas is not None:
        g_run, g_src = replicas, "--replicas"
    elif isinstance(res.meta.get("engine_replicas"), int):
        g_run, g_src = int(res.meta["engine_replicas"]), "the run's fleet"
    else:
        g_run, g_src = 1, "assumed (pass --replicas)"
    if peak_rate is not None:
        lam, lam_src = peak_rate, "--peak-rate"
    else:
        lam, lam_src = max(r.rate for r in runs), "the highest offered rate of the run"
    # Saturated: the best point completed clearly less than was offered to it.
    saturated = x_sat < 0.9 * best.rate
    if not saturated:
        notes.append(
            "the sweep never saturated this target: X_sat is a lower bound on capacity, "
            "so E[S] is an upper bound and g_min errs high; extend the sweep"
        )
    e_s = g_run / x_sat
    g_min = max(1, math.ceil(lam * e_s / rho_max - 1e-9))
    cap = res.capacity.get(name)
    per_replica = cap.max_rate / g_run if cap is not None and cap.max_rate else None
    g_slo = max(1, math.ceil(lam / per_replica - 1e-9)) if per_replica else None
    if cap is not None and cap.all_held:
        notes.append("every swept rate held the SLO: the SLO-based figure is conservative")
    return PlanResult(
        target=name,
        lambda_peak=lam,
        lambda_source=lam_src,
        x_sat=x_sat,
        x_sat_offered=best.rate,
        replicas=g_run,
        replicas_source=g_src,
        e_s=e_s,
        rho_max=rho_max,
        g_min=g_min,
        saturated=saturated,
        slo_rate_per_replica=per_replica,
        g_slo=g_slo,
        notes=notes,
    )


def render(p: PlanResult, source: str = "") -> str:
    lines = [
        f"capacity plan for target {p.target!r}" + (f" from {source}" if source else ""),
        f"  lambda_peak = {p.lambda_peak:g} req/s  ({p.lambda_source})",
        f"  X_sat       = {p.x_sat:.3f} req/s  (highest completed throughput, "
        f"at offered {fmt_rate(p.x_sat_offered)} req/s)",
        f"  replicas    = {p.replicas}  ({p.replicas_source}: engine replicas behind the target)",
        f"  E[S]        = replicas / X_sat = {p.e_s:.4f} s of one replica per request",
        f"  rho_max     = {p.rho_max:g}",
        f"  g_min       = ceil(lambda_peak * E[S] / rho_max) = "
        f"ceil({p.lambda_peak:g} * {p.e_s:.4f} / {p.rho_max:g}) = "
        f"ceil({p.lambda_peak * p.e_s / p.rho_max:.3f}) = {p.g_min}",
    ]
    if p.slo_rate_per_replica is not None and p.g_slo is not None:
        lines.append(
            f"  the sweep held the SLO up to {p.slo_rate_per_replica:g} req/s per replica: "
            f"ceil({p.lambda_peak:g} / {p.slo_rate_per_replica:g}) = {p.g_slo} replicas"
        )
    else:
        lines.append("  the sweep did not hold the SLO at any rate: no SLO-based figure")
    lines += [f"note: {n}" for n in p.notes]
    lines.append(WARNING)
    return "\n".join(lines)

"""Executor metrics, in a per-process registry. Labels are statuses and codes,
never run ids, tenants' text or prompt content."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.steps = Counter(
            "jetserve_agent_steps",
            "Step messages handled, by outcome (ack, nak, term, busy, conflict, stuck, error)",
            ["outcome"],
            registry=r,
        )
        self.step_duration = Histogram(
            "jetserve_agent_step_duration_seconds",
            "One step message, handled",
            buckets=_STEP_S,
            registry=r,
        )
        self.inflight = Gauge("jetserve_agent_steps_inflight", "Steps being handled", registry=r)
        self.runs = Counter(
            "jetserve_agent_runs_ended",
            "Runs that reached a terminal status",
            ["status"],
            registry=r,
        )
        self.model_calls = Counter("jetserve_agent_model_calls", "Model calls answered", registry=r)
        self.model_failures = Counter(
            "jetserve_agent_model_failures",
            "Model calls that failed, by code",
            ["code"],
            registry=r,
        )
        self.tokens = Counter(
            "jetserve_agent_tokens", "Tokens of model calls of runs", ["direction"], registry=r
        )
        self.tool_results = Counter(
            "jetserve_agent_tool_results",
            "Tool results recorded in runs, by status",
            ["status"],
            registry=r,
        )

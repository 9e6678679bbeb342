"""Gateway metrics in a per-app registry (no process-global state). Labels are
low-cardinality: operation, class, outcome. Never request ids or text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "jetserve_gateway_requests",
            "Requests by terminal outcome",
            ["op", "cls", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "jetserve_gateway_rejected", "Requests refused before dispatch", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "jetserve_gateway_time_to_first_token_seconds",
            "Time to first token at the gateway",
            ["cls"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jetserve_gateway_request_duration_seconds",
            "End-to-end request latency",
            ["op", "cls"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "jetserve_gateway_tokens", "Tokens by direction", ["cls", "direction"], registry=r
        )
        self.inflight = Gauge("jetserve_gateway_inflight", "Requests in flight", registry=r)
        self.queue_depth = Gauge(
            "jetserve_queue_depth",
            "Work-queue lag per class (num_pending + num_ack_pending)",
            ["cls"],
            registry=r,
        )

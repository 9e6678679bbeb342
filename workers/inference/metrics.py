"""Worker metrics in a per-worker registry, served on the worker's own port.

Names follow the OpenTelemetry GenAI server conventions where one exists
(``gen_ai.server.time_to_first_token`` -> ``gen_ai_server_time_to_first_token_seconds``
in Prometheus form); the rest are ``jetserve_worker_*``. Labels are low-cardinality:
class and outcome only; Prometheus adds the instance.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, from /proc at scrape time
        self.requests = Counter(
            "jetserve_worker_requests",
            "Requests by terminal outcome",
            ["cls", "outcome"],
            registry=r,
        )
        self.redeliveries = Counter(
            "jetserve_worker_redeliveries",
            "Requests handed back for another attempt (nak)",
            ["cls", "reason"],
            registry=r,
        )
        self.acks_unconfirmed = Counter(
            "jetserve_worker_acks_unconfirmed",
            "First-token acks the server did not confirm at once (retried meanwhile)",
            ["cls"],
            registry=r,
        )
        self.lane_members = Gauge(
            "jetserve_worker_lane_members",
            "Live workers this one ranks lanes among (itself included)",
            registry=r,
        )
        self.lane_stale_pullers = Gauge(
            "jetserve_worker_lane_stale_pullers",
            "Lane pullers whose standing pulls carry ranks from before the last "
            "membership change (withdrawn at their next turn)",
            registry=r,
        )
        self.lane_events = Counter(
            "jetserve_worker_lane_events",
            "Lane pulls made (pull); messages handed back, the worker full (handed_back)",
            ["event"],
            registry=r,
        )
        self.pending_peeks = Counter(
            "jetserve_worker_pending_peeks",
            "A lower class's puller asking whether its consumer holds work before taking "
            "a slot, by where the answer came from: the fleet's depth look, or the server",
            ["source"],
            registry=r,
        )
        self.kv_keys = Gauge(
            "jetserve_worker_kv_index_keys",
            "Prefix keys the engine holds, as told to the fleet's KV index (--kv-events)",
            registry=r,
        )
        self.kv_blocks = Gauge(
            "jetserve_worker_kv_event_blocks",
            "Cached blocks the engine's KV events say it holds",
            registry=r,
        )
        self.kv_learnt = Counter(
            "jetserve_worker_kv_index_requests",
            "Requests with prefix keys, by whether their blocks were found (learnt) "
            "or not (unattributed: a prompt cached whole, or concurrent look-alikes)",
            ["outcome"],
            registry=r,
        )
        self.block_waits = Counter(
            "jetserve_worker_block_waits",
            "Requests that waited for KV blocks: their prompt + max_tokens did not fit yet",
            ["cls"],
            registry=r,
        )
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Engine call start to first token",
            ["cls"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Per-request (e2e - TTFT)/(out - 1)",
            ["cls"],
            buckets=_TPOT,
            registry=r,
        )
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Engine call duration",
            ["cls"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens = Counter(
            "jetserve_worker_tokens", "Tokens by type", ["cls", "type"], registry=r
        )
        self.inflight = Gauge(
            "jetserve_worker_inflight", "Requests held by this worker", registry=r
        )
        self.kv_headroom = Gauge(
            "jetserve_worker_kv_headroom_ratio",
            "Share of the engine's KV blocks not reserved by this worker's requests",
            registry=r,
        )
        self.capped = Counter(
            "jetserve_worker_capped_seconds",
            "Time serving --max-inflight requests while the engine had room for more "
            "(nothing waiting, KV to spare), sampled at each look at the engine",
            registry=r,
        )
        self.engine_waiting = Gauge(
            "jetserve_worker_engine_waiting", "The engine's own waiting queue", registry=r
        )
        self.engine_kv_usage = Gauge(
            "jetserve_worker_engine_kv_usage_ratio", "The engine's own KV cache usage", registry=r
        )
        self.embed_batch_size = Histogram(
            "jetserve_worker_embed_batch_size",
            "Embedding requests merged into one engine call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.engine_up = Gauge(
            "jetserve_worker_engine_up", "1 when the engine answered its last probe", registry=r
        )

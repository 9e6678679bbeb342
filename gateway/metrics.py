"""Gateway metrics in a per-app registry (no process-global state). Labels are
low-cardinality: operation, class, outcome; tenants only from an allow-list
(everyone else is ``other``). Never request ids or text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, tenants: tuple[str, ...] = ()) -> None:
        self.registry = CollectorRegistry()
        self._tenants = frozenset(tenants)
        r = self.registry
        # process_cpu_seconds_total and the rest, read from /proc at scrape time:
        # what an operator scales gateway processes by (docs/bench.md).
        ProcessCollector(registry=r)
        self.tenant_requests = Counter(
            "jetserve_gateway_tenant_requests",
            "Requests by tenant (allow-listed tenants; the rest are 'other') and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tpot = Histogram(
            "jetserve_gateway_time_per_output_token_seconds",
            "Per request (e2e - TTFT) / (output tokens - 1), as vLLM defines TPOT",
            ["cls"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
            registry=r,
        )
        self.consumer_pending = Gauge(
            "jetserve_consumer_pending",
            "Messages not yet delivered, per class",
            ["cls"],
            registry=r,
        )
        self.fair_waiting = Gauge(
            "jetserve_gateway_fair_waiting",
            "Requests held at this gateway for their tenant's turn, per class",
            ["cls"],
            registry=r,
        )
        self.fair_passes = Counter(
            "jetserve_gateway_fair_passes_total",
            "Requests the fair gate let go while engaged, per class and way: in_turn "
            "(at once, to the class subject), excess (waited, to the excess subject), "
            "waited (then to the class subject: its tenant alone in the class, "
            "or its last waiting), left (its client hung up while it waited: never published)",
            ["cls", "way"],
            registry=r,
        )
        self.consumer_ack_pending = Gauge(
            "jetserve_consumer_ack_pending",
            "Messages delivered to a worker and not yet acked, per class",
            ["cls"],
            registry=r,
        )
        self.requests = Counter(
            "jetserve_gateway_requests",
            "Requests by terminal outcome",
            ["op", "cls", "outcome"],
            registry=r,
        )
        self.idempotent_attached = Counter(
            "jetserve_gateway_idempotent_attached",
            "Idempotency-Key retries that followed the first run's frames instead of running",
            registry=r,
        )
        self.settlements = Counter(
            "jetserve_gateway_settlements",
            "Settlements of the books by path: inline, deferred (left in the outbox), "
            "from_outbox, orphan, released, outbox_retry, hold_missing, dead_lettered, split",
            ["path"],
            registry=r,
        )
        self.rejected = Counter(
            "jetserve_gateway_rejected", "Requests refused before dispatch", ["reason"], registry=r
        )
        self.refusals_summarised = Counter(
            "jetserve_gateway_refusals_summarised",
            "Refusals past a tenant's ledger record rate, counted into a summary record",
            registry=r,
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
        self.nats_unauthenticated = Gauge(
            "jetserve_gateway_nats_unauthenticated",
            "NATS ingress requests whose key is being checked (at most "
            "--nats-max-unauthenticated; the rest wait in the subscription)",
            ["ingress"],
            registry=r,
        )
        self.coalesced = Counter(
            "jetserve_gateway_coalesced",
            "Requests that followed an identical in-flight T=0 request (one shared execution)",
            registry=r,
        )
        self.hedges = Counter(
            "jetserve_gateway_hedges",
            "Hedged attempts: sent, won (the copy emitted first), lost, capped, failed",
            ["cls", "outcome"],
            registry=r,
        )
        self.client_left = Counter(
            "jetserve_gateway_client_left",
            "Clients that hung up on an accepted request (or cancelled it): in_flight (the "
            "request was cancelled or left to a resume grace), at_end (it already had its "
            "outcome, being recorded: nothing changes)",
            ["when"],
            registry=r,
        )
        self.queue_checks = Counter(
            "jetserve_gateway_queue_checks",
            "Lost-answer checks of requests silent before their first token: queued (still "
            "in the work queue), gone (taken: silent a heartbeat timeout more, the answer "
            "counts as lost), unknown (the bus could not say)",
            ["result"],
            registry=r,
        )
        self.kv_routes = Counter(
            "jetserve_gateway_kv_routes",
            "Affinity requests on the shared lanes with the KV index on (--kv-index), by "
            "what chose the lane: index (a replica holds its prefix), hash (cold or none does)",
            ["source"],
            registry=r,
        )
        self.kv_index_entries = Gauge(
            "jetserve_gateway_kv_index_entries",
            "(prefix key, replica) entries in this gateway's KV index",
            registry=r,
        )
        self.kv_index_replicas = Gauge(
            "jetserve_gateway_kv_index_replicas",
            "Replicas with entries in this gateway's KV index",
            registry=r,
        )
        self.kv_index_members = Gauge(
            "jetserve_gateway_kv_index_members",
            "Live workers the KV index routes among (their lane ownership), as this gateway sees",
            registry=r,
        )
        self.pool_workers = Gauge(
            "jetserve_gateway_pool_workers",
            "Live workers per deployment pool, as this gateway sees the members",
            ["deployment"],
            registry=r,
        )
        # Rollouts (docs/rollout.md): per route and arm, this gateway's share.
        self.rollout_requests = Counter(
            "jetserve_rollout_requests",
            "Requests inside a canary's scope by route, arm (stable|canary) and result "
            "(ok, error: a 5xx, other: refused or cancelled by the client)",
            ["route", "arm", "result"],
            registry=r,
        )
        self.rollout_ttft = Histogram(
            "jetserve_rollout_ttft_seconds",
            "Time to first token inside a canary's scope, by route and arm",
            ["route", "arm"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rollout_rollbacks = Counter(
            "jetserve_rollout_rollbacks",
            "Route rollbacks by route and trigger (manual: the admin API; guard: automatic)",
            ["route", "trigger"],
            registry=r,
        )
        self.rollout_shadows = Counter(
            "jetserve_rollout_shadows",
            "Shadow copies by route and result (ok, error, skipped: too many in flight; "
            "budget_exhausted: the operator budget is spent; refused: another operator limit)",
            ["route", "result"],
            registry=r,
        )
        self.rollout_guard_leader = Gauge(
            "jetserve_rollout_guard_leader",
            "1 while this gateway holds the rollout guard's lease (one gateway of the fleet)",
            registry=r,
        )
        self.rollout_guard_ratio = Gauge(
            "jetserve_rollout_guard_ratio",
            "The rollout guard's last figures per route: canary over stable "
            "(figure: error, ttft_p95), set by the lease holder once both arms have min_samples",
            ["route", "figure"],
            registry=r,
        )
        self.rollout_window_records = Gauge(
            "jetserve_rollout_window_records",
            "Ledger samples the rollout guard's lease holder keeps in memory (its window)",
            registry=r,
        )
        # Evidence re-evaluation (gateway/admin/evidence_watch.py), by the lease holder.
        self.evidence_due = Gauge(
            "jetserve_route_evidence_due",
            "1 while a route's evidence has a fired re-evaluation trigger, per trigger kind "
            "(fingerprint_changed, adapter_changed, engine_changed, price_changed, expired, "
            "slo_regression); set by the rollout guard's lease holder",
            ["route", "kind"],
            registry=r,
        )
        self.evidence_fired = Counter(
            "jetserve_route_evidence_triggers_fired",
            "Re-evaluation triggers seen to fire, per route and kind (counted once per "
            "firing by the lease holder that saw it)",
            ["route", "kind"],
            registry=r,
        )
        self.depth_reader = Gauge(
            "jetserve_gateway_depth_reader",
            "1 while this gateway is the fleet's elected queue-depth reader",
            registry=r,
        )
        self.depth_looks = Counter(
            "jetserve_gateway_depth_looks",
            "Queue-depth looks this gateway took: read (it listed the consumers) "
            "or heard (the elected reader published it)",
            ["source"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "jetserve_queue_depth",
            "Work-queue lag per class (num_pending + num_ack_pending) of its shared "
            "queue: what any worker of the class takes",
            ["cls"],
            registry=r,
        )
        self.pool_queue_depth = Gauge(
            "jetserve_pool_queue_depth",
            "Work-queue lag (num_pending + num_ack_pending) of one deployment pool's "
            "queue of a class: what only that deployment's workers take",
            ["cls", "deployment"],
            registry=r,
        )

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self._tenants else "other"

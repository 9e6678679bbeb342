"""Gateway settings: one immutable object handed to the app factory (no globals)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gateway.tenancy.pricing import PriceBook
from streams.connect import OPEN, BusAuth
from streams.definitions import DEFAULT_TOPOLOGY, Topology
from streams.routes import CoalescePolicy, HedgePolicy, RoutingPolicy


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str
    redis_url: str
    # The gateway's own credentials (jetserve/credentials.py); OPEN only with --insecure.
    nats_auth: BusAuth = OPEN
    redis_password: str | None = None
    # ``redis_url`` names one node of a Redis Cluster (streams/redis_client.py).
    redis_cluster: bool = False
    models: tuple[str, ...] = ("sim-8b",)
    embedding_models: tuple[str, ...] = ()  # listed by /v1/models only when served
    gateway_id: str = field(default_factory=lambda: f"gw{uuid.uuid4().hex[:10]}")
    # On SIGTERM, how long requests in flight have to end (--grace) before the
    # gateway ends them itself.
    shutdown_grace_s: float = 30.0
    default_timeout_s: float = 120.0
    max_timeout_s: float = 600.0
    # After the first token, this long without a frame (tokens or heartbeats)
    # means the worker is gone: the client gets ``stream_interrupted``.
    heartbeat_timeout_s: float = 3.0
    # A streaming response is committed (200 + headers) at the first frame, or
    # after this long in the queue; from then on errors arrive as SSE events.
    commit_after_s: float = 5.0
    keepalive_s: float = 10.0
    # Frames buffered per request while its client is not reading (writes are
    # coalesced when it reads again). Past this the client is too slow: its
    # stream ends with ``client_too_slow`` and the upstream is cancelled.
    max_buffered_frames: int = 1024
    # After a client disconnects, how long it has to resume (Last-Event-ID) before
    # the upstream is cancelled. 0: cancel at once (the engine stops immediately).
    resume_grace_s: float = 0.0
    # The books (gateway/inference/settlements.py): a request's hold outlives its
    # deadline by ``settle_grace_s``, after which the orphan sweep settles it from
    # the frames capture; the outbox scan applies what a gateway could not within
    # ``outbox_grace_s`` and runs every ``outbox_scan_s``.
    settle_grace_s: float = 60.0
    outbox_grace_s: float = 10.0
    outbox_scan_s: float = 5.0
    sweep_s: float = 30.0
    # Refusals before any hold (budget, rate) get a ledger record each at this
    # rate per tenant after a burst; past it they are counted, and summarised
    # once per window (gateway/tenancy/refusal_records.py).
    refusal_records_per_s: float = 2.0
    refusal_records_burst: int = 100
    refusal_summary_s: float = 10.0
    # The rollout guard (gateway/admin/rollout_guard.py): how often the gateway
    # holding its lease compares each canary's arms; 0: this gateway never does.
    rollout_guard_every_s: float = 2.0
    # The queue-depth reader's election (gateway/inference/depth_share.py): how
    # often the reader renews its lease and republishes; 0: no election, this
    # gateway looks at the queues itself (one gateway, or a test of one).
    depth_reader_renew_s: float = 2.0
    # The evidence watch (gateway/admin/evidence_watch.py), run by the same lease
    # holder: how often every route's evidence triggers are evaluated; 0: never.
    evidence_watch_every_s: float = 30.0
    # Idempotency-Key: how long a key's answer is kept (and a retry attaches to
    # the first attempt's stream). The frames capture and the work queue's
    # de-duplication window must cover it (checked at start-up).
    idempotency_window_s: float = 600.0
    # A retry that finds the first run claimed but nothing queued takes it over
    # after this long from the claim (its gateway died in between).
    idempotency_takeover_s: float = 5.0
    default_max_tokens: int = 512  # worst case for admission when the body sets none
    # model -> max_model_len, for models whose route contract names none: prompt +
    # max_tokens past it is refused with 400 before any hold (unknown: no check).
    context_lengths: dict[str, int] = field(default_factory=dict)
    # Engine-facing request headers passed through to workers (route policy).
    # Off by default; ``jetserve up`` and the tests allow the simulator's ``x-sim-``.
    forward_header_prefixes: tuple[str, ...] = ()
    key_cache_s: float = 1.0  # a revoked key dies on every replica within this
    topology: Topology = DEFAULT_TOPOLOGY
    prices: PriceBook = field(default_factory=PriceBook)
    # The control plane: its own port and credential. No token -> the admin API
    # refuses everything (fail closed), it is never open by default.
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    admin_token_sha256: str | None = None
    # API keys are stored as HMAC-SHA-256 under this secret (JETSERVE_KEY_SECRET),
    # the same on every replica. Empty: not configured, and the runtime refuses
    # to start (the CLI passes a public development value under --insecure).
    key_secret: bytes = field(default=b"", repr=False)
    # Separation of duties: the key that created a run may not decide its gated
    # calls unless this is set (single-operator development setups).
    allow_self_approval: bool = False
    # /metrics on its own listener, never on the public port; None: not served.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    metrics_tenants: tuple[str, ...] = ()
    # OpenTelemetry span export (needs the ``otel`` extra): "otlp+http://host:4318"
    # or "file:///path.jsonl". None: only W3C ids travel, nothing is exported.
    otel_exporter: str | None = None  # tenants named in metrics; the rest are "other"
    # Agent runs: the deadline when a run names none, and the longest allowed
    # (a run may wait hours on a human approval).
    run_default_timeout_s: float = 600.0
    run_max_timeout_s: float = 86_400.0
    # For models without a route contract (a contract's own policies win).
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    hedge: HedgePolicy = field(default_factory=HedgePolicy)
    # Route affinity requests by the fleet's KV index (vLLM KV events from the
    # workers, gateway/inference/kv_routing.py), hash lanes where it says nothing.
    kv_index: bool = False
    # Refuse (429) what the queue ahead would keep past its deadline.
    shed: bool = True
    # Tenants in turn within a class: the class's queue kept short, the rest held
    # here per tenant (gateway/inference/fair_gate.py).
    fair: bool = True
    # Identical temperature-0 requests share one execution (gateway/inference/coalesce.py).
    coalesce: CoalescePolicy = field(default_factory=CoalescePolicy)
    # The HTTP and WebSocket edge (gateway/ingress/limits.py, http_protocol.py, ws.py):
    # every limit is checked before any work (no body read, no auth, no parse).
    max_body_bytes: int = 4 * 1024 * 1024  # 413 past it; a chunked body is cut there
    max_header_bytes: int = 64 * 1024  # the request line and headers together: 431
    max_headers: int = 100  # 431 past it
    # SO_SNDBUF of each client connection (0: the kernel's autotuning, up to
    # tcp_wmem's max, 4 MiB by default): what a client that stops reading can
    # park in the kernel before the gateway's own bounded buffer fills and ends it.
    client_send_buffer_bytes: int = 0
    # A request's head and body must arrive within this of its first byte (of the
    # connection's, for its first): 408 and closed past it (slowloris).
    request_read_timeout_s: float = 30.0
    # A connection idle this long between requests is closed. Longer than a load
    # balancer's or client pool's idle timeout (an ALB's 60 s, httpx's 5 s), so the
    # other side always gives up first: at uvicorn's 5 s, a client reusing a
    # connection as the gateway closed it got a reset (an ALB answers that 502).
    keep_alive_s: float = 75.0
    ws_max_message_bytes: int = 1024 * 1024  # a larger message closes the socket (1009)
    ws_max_inflight: int = 16  # requests per socket; past it that request gets a 429
    # NATS ingress: requests of one tenant in flight on this replica (a service's
    # connection is no socket of ours to count); past it a 429 ``too_many_inflight``.
    nats_max_inflight: int = 1024
    # NATS ingress: requests whose key is not yet authenticated, on this replica;
    # past it the subscriptions wait (gateway/ingress/nats_tasks.py).
    nats_max_unauthenticated: int = 256
    ws_idle_timeout_s: float = 300.0  # no frame and nothing in flight: closed (1000)
    # A send that waits this long for the client to read (its window full) aborts
    # the connection (gateway/ingress/ws_protocol.py).
    ws_send_timeout_s: float = 30.0
    ws_ticket_ttl_s: int = 30  # POST /v1/ws/tickets: single use, this long
    # ``?api_key=`` on the upgrade puts the key in URLs (proxy logs, history): off.
    ws_allow_query_key: bool = False

"""``jetserve gateway``: the OpenAI-compatible HTTP/SSE/WebSocket + NATS ingress."""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
from typing import TYPE_CHECKING

from jetserve.commands.common import (
    DEFAULT_NATS,
    DEFAULT_REDIS,
    OTEL_EXPORTER,
    OTEL_HELP,
    REDIS_CLUSTER_HELP,
    REPLICAS_HELP,
    add_bus_args,
    bus_auth,
    redis_password,
    split_csv,
)

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from jetserve.commands.common import Subparsers
    from streams.definitions import Topology
    from streams.routes import HedgePolicy

log = logging.getLogger(__name__)
KEY_SECRET_ENV = "JETSERVE_KEY_SECRET"


def frames_topology(args: argparse.Namespace) -> Topology:
    """The topology of ``--replicas``, ``--frames-partitions``, ``--class-streams``
    and ``--lane-load-factor``."""
    from streams.definitions import Topology

    try:
        return Topology(
            replicas=args.replicas,
            frames_partitions=args.frames_partitions,
            class_streams=args.class_streams or args.lane_shards > 1,
            lane_shards=args.lane_shards,
            lane_load_factor=args.lane_load_factor,
        )
    except ValueError as exc:
        raise SystemExit(f"--frames-partitions, --lane-shards, --lane-load-factor: {exc}") from None


def lane_topology(topo: Topology, specs: list[str]) -> Topology:
    """``topo`` with ``--lanes`` applied: ``N`` for every lane class, ``CLASS=N`` for one."""
    import dataclasses

    from streams.subjects import LANE_CLASSES, RequestClass

    lanes, per_class = topo.lanes, dict(topo.class_lanes)
    for spec in specs:
        name, _, count = spec.rpartition("=")
        try:
            n = int(count)
            cls = RequestClass(name) if name else None
        except ValueError:
            raise SystemExit(f"--lanes {spec!r}: want N or CLASS=N") from None
        if not 0 <= n <= 4096 or (cls is not None and cls not in LANE_CLASSES):
            raise SystemExit(f"--lanes {spec!r}: 0..4096 lanes, classes {list(LANE_CLASSES)}")
        if cls is None:
            lanes = n
        else:
            per_class[cls] = n
    return dataclasses.replace(topo, lanes=lanes, class_lanes=tuple(per_class.items()))


def register(sub: Subparsers) -> None:
    g = sub.add_parser(
        "gateway", allow_abbrev=False, help="OpenAI-compatible HTTP/SSE/WebSocket + NATS ingress"
    )
    g.add_argument("--nats", default=DEFAULT_NATS)
    add_bus_args(g)
    g.add_argument("--redis", default=DEFAULT_REDIS)
    g.add_argument("--redis-cluster", action="store_true", help=REDIS_CLUSTER_HELP)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--otel-exporter", default=OTEL_EXPORTER, help=OTEL_HELP)
    g.add_argument("--replicas", type=int, default=1, help=REPLICAS_HELP)
    g.add_argument("--port", type=int, default=8080)
    g.add_argument(
        "--lanes",
        action="append",
        default=[],
        metavar="N|CLASS=N",
        help="prefix-affinity lanes per lane class (default 256), or one class's "
        "(repeatable); recorded in the stream when it is first provisioned, which then wins",
    )
    g.add_argument(
        "--lane-load-factor",
        type=float,
        default=1.4,  # streams.rendezvous.DEFAULT_LOAD_FACTOR (the CLI starts light)
        metavar="F",
        help="no worker owns more than F times its share of a class's lanes (1..4); "
        "recorded in the stream when it is first provisioned, which then wins: every "
        "worker and gateway computes the same owners (docs/routing.md)",
    )
    g.add_argument(
        "--class-streams",
        action="store_true",
        help="one work-queue stream per request class (JETSERVE_REQ_<CLASS>), each with its "
        "own leader, instead of one for all (docs/scale.md); recorded when the streams are "
        "first provisioned, which then wins; workers and executors follow it",
    )
    g.add_argument(
        "--lane-shards",
        type=int,
        default=1,
        metavar="N",
        help="with --class-streams (implied): each lane class's stream split in N (1..8) by "
        "lane, so one busy class is not one stream's write rate (docs/scale.md)",
    )
    g.add_argument(
        "--frames-partitions",
        type=int,
        default=1,
        metavar="N",
        help="capture streams of the reply frames, 1..16: a request's "
        "by a hash of its id (docs/scale.md); recorded in the stream when it is first "
        "provisioned, which then wins",
    )
    g.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind the public port with SO_REUSEPORT: several gateway processes share it",
    )
    g.add_argument("--models", default="sim-8b", help="comma-separated chat/completion models")
    g.add_argument(
        "--embedding-models",
        default="",
        help="comma-separated embedding models (none by default: /v1/models lists only "
        "what is served)",
    )
    g.add_argument("--timeout", type=float, default=120.0, help="default request deadline (s)")
    g.add_argument("--heartbeat-timeout", type=float, default=3.0)
    g.add_argument("--keepalive", type=float, default=10.0, help="SSE keep-alive interval (s)")
    g.add_argument(
        "--max-buffered-frames",
        type=int,
        default=1024,
        help="frames held per slow client before its stream is ended",
    )
    g.add_argument(
        "--resume-grace",
        type=float,
        default=0.0,
        help="seconds a disconnected client has to resume before the upstream is cancelled",
    )
    g.add_argument(
        "--commit-after", type=float, default=5.0, help="send stream headers after this wait (s)"
    )
    g.add_argument("--forward-header-prefix", default="", help="engine headers allowed through")
    g.add_argument("--grace", type=float, default=30.0, help="graceful shutdown (s)")
    _admin_and_pricing(g)
    _routing(g)
    _metrics_and_approvals(g)
    _edge_limits(g)
    g.set_defaults(func=run)


def _edge_limits(g: argparse.ArgumentParser) -> None:
    """The HTTP and WebSocket limits (docs/security.md), checked before any work."""
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="request body cap: 413, connection closed (default 4 MiB)",
    )
    g.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        help="request line and headers together: 431 past it (default 64 KiB)",
    )
    g.add_argument("--max-headers", type=int, default=100, help="request headers: 431 past it")
    g.add_argument(
        "--client-send-buffer",
        type=_send_buffer,
        default=0,
        help="SO_SNDBUF of each client connection, bytes (0: the kernel's autotuning): "
        "bounds what a client that stops reading parks in the kernel (default 0)",
    )
    g.add_argument(
        "--request-read-timeout",
        type=_positive,
        default=30.0,
        help="seconds for a request's head and body to arrive, from its first byte "
        "(a new connection's, for its first): 408 and closed past it (default 30)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=_positive,
        default=75.0,
        help="close a client connection idle this long between requests (s, default 75: "
        "longer than a load balancer's idle timeout, e.g. 60 s, so that it never reuses "
        "a connection the gateway is closing)",
    )
    g.add_argument(
        "--ws-max-message-bytes",
        type=int,
        default=1024 * 1024,
        help="a longer WebSocket message closes the socket with 1009 (default 1 MiB)",
    )
    g.add_argument(
        "--ws-max-inflight",
        type=int,
        default=16,
        help="requests in flight per WebSocket; past it a request gets a 429 error frame",
    )
    g.add_argument(
        "--nats-max-inflight",
        type=int,
        default=1024,
        help="requests of one tenant in flight through the NATS ingress on this replica; "
        "past it a request gets a 429 reply (too_many_inflight)",
    )
    g.add_argument(
        "--nats-max-unauthenticated",
        type=_at_least_one,
        default=256,
        help="NATS ingress requests waiting for their key's check at once on this replica; "
        "past it the ingress stops taking messages until one is checked (a flood of "
        "made-up keys while Redis is slow costs bounded memory)",
    )
    g.add_argument(
        "--ws-idle-timeout",
        type=float,
        default=300.0,
        help="close a WebSocket after this long without a frame and nothing in flight (s)",
    )
    g.add_argument(
        "--ws-send-timeout",
        type=_positive,
        default=30.0,
        help="abort a WebSocket whose client has not read for this long while a send waits (s)",
    )
    g.add_argument(
        "--ws-ticket-ttl",
        type=int,
        default=30,
        help="seconds a WebSocket ticket (POST /v1/ws/tickets) stays valid; single use",
    )
    g.add_argument(
        "--ws-allow-query-key",
        action="store_true",
        help="accept ?api_key= on the WebSocket upgrade (off: keys in URLs leak; use tickets)",
    )


def _metrics_and_approvals(g: argparse.ArgumentParser) -> None:
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port (its own listener); off when not set",
    )
    g.add_argument("--metrics-host", default="127.0.0.1", help="/metrics address (keep private)")
    g.add_argument(
        "--metrics-tenants",
        default="",
        help="tenants named in metric labels (default none: every tenant is 'other')",
    )
    g.add_argument(
        "--allow-self-approval",
        action="store_true",
        help="let the key that created a run decide its gated calls (off: separation of duties)",
    )


def _admin_and_pricing(g: argparse.ArgumentParser) -> None:
    g.add_argument("--admin-host", default="127.0.0.1", help="admin API address (keep private)")
    g.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="admin API port (credential: JETSERVE_ADMIN_TOKEN_FILE or JETSERVE_ADMIN_TOKEN); "
        "off when not set",
    )
    g.add_argument(
        "--price",
        action="append",
        default=[],
        help="MODEL=IN/OUT micro-USD per 1K tokens (repeatable)",
    )
    g.add_argument("--price-version", default="v1")


MAX_SEND_BUFFER = 64 << 20


def _send_buffer(text: str) -> int:
    """0 (the kernel's autotuning) or 4 KiB .. 64 MiB."""
    if not text.isdigit() or not (int(text) == 0 or 4096 <= int(text) <= MAX_SEND_BUFFER):
        raise argparse.ArgumentTypeError(f"want 0 or 4096..{MAX_SEND_BUFFER} bytes, got {text!r}")
    return int(text)


def _positive(text: str) -> float:
    """Seconds, above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"want a number of seconds above 0, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"want a number 0 or above, got {text!r}")
    return value


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"want a whole number 0 or above, got {text!r}")
    return int(text)


def _at_least_one(text: str) -> int:
    if _count(text) < 1:
        raise argparse.ArgumentTypeError(f"want a whole number 1 or above, got {text!r}")
    return int(text)


def _context_length(text: str) -> tuple[str, int]:
    model, sep, tokens = text.rpartition("=")
    if not sep or not model or not tokens.isdigit() or int(tokens) < 1:
        raise argparse.ArgumentTypeError(f"--context-length wants MODEL=TOKENS, got {text!r}")
    return model, int(tokens)


def _routing(g: argparse.ArgumentParser) -> None:
    g.add_argument(
        "--context-length",
        action="append",
        default=[],
        type=_context_length,
        metavar="MODEL=TOKENS",
        help="a model's max_model_len (prompt + output) where no route contract names one: "
        "past it, 400 context_length_exceeded before any hold; repeatable",
    )
    g.add_argument("--coalesce", action="store_true", help="share identical T=0 requests")
    g.add_argument(
        "--routing",
        choices=("affinity", "round_robin", "least_loaded"),
        default="affinity",
        help="routing for models without a route contract",
    )
    g.add_argument(
        "--kv-index",
        action="store_true",
        help="route affinity requests to the replica whose engine holds the longest cached "
        "prefix, by the fleet's KV index (workers with --kv-events); hash lanes otherwise",
    )
    g.add_argument(
        "--hedge",
        default=None,
        metavar="p95|SECONDS",
        help="hedge late first tokens for models without a route contract (off by default)",
    )
    g.add_argument("--hedge-max-extra", type=float, default=0.1, help="hedges per request at most")
    g.add_argument(
        "--no-shed", action="store_true", help="queue what cannot meet its deadline (no 429)"
    )
    g.add_argument(
        "--no-fair",
        action="store_true",
        help="one first-come queue per class for every tenant (no tenant turns)",
    )
    b = g.add_argument_group("books (docs/reliability.md, the settlement outbox)")
    b.add_argument(
        "--settle-grace",
        type=float,
        default=60.0,
        help="a request's budget hold outlives its deadline by this (s); then the orphan "
        "sweep settles it from the frames capture",
    )
    b.add_argument("--sweep-every", type=float, default=30.0, help="orphan sweep interval (s)")
    b.add_argument(
        "--outbox-grace",
        type=float,
        default=10.0,
        help="a settlement its gateway has not applied after this (s) is applied by any replica",
    )
    b.add_argument("--outbox-scan", type=float, default=5.0, help="outbox scan interval (s)")
    b.add_argument(
        "--refusal-records-per-s",
        type=_non_negative,
        default=2.0,
        help="refusals before a hold (budget, rate) recorded one by one per tenant and "
        "second, after a burst; past it they are counted into summary records",
    )
    b.add_argument(
        "--refusal-records-burst", type=_count, default=100, help="the burst of those records"
    )
    b.add_argument(
        "--refusal-summary-every",
        type=_positive,
        default=10.0,
        help="the counted refusals are summarised this often (s)",
    )
    b.add_argument(
        "--rollout-guard-every",
        type=float,
        default=2.0,
        help="how often the gateway holding the rollout guard's lease compares each "
        "canary's arms and rolls a failing one back (s); 0: never on this gateway",
    )
    b.add_argument(
        "--depth-reader-renew",
        type=float,
        default=2.0,
        help="one gateway of the fleet, elected by lease, reads the queue depths and "
        "publishes them; it renews every this many seconds and a dead reader is "
        "replaced within 3x (docs/routing.md); 0: this gateway reads them itself",
    )
    b.add_argument(
        "--evidence-watch-every",
        type=float,
        default=30.0,
        help="how often the same lease holder evaluates every route's evidence triggers "
        "(s; docs/rollout.md); 0: never",
    )
    b.add_argument(
        "--idempotency-window",
        type=float,
        default=600.0,
        help="Idempotency-Key answers are kept this long from the first request (s); "
        "at most the frames capture's and the work queue's de-duplication window",
    )


def hedge_policy(spec: str | None, max_extra: float) -> HedgePolicy:
    """``--hedge p95|SECONDS`` as a policy; off when not given."""
    from streams.routes import HedgePolicy

    if spec is None:
        return HedgePolicy()
    if spec == "p95":
        return HedgePolicy(enabled=True, delay="p95", max_extra_ratio=max_extra)
    return HedgePolicy(enabled=True, delay=float(spec), max_extra_ratio=max_extra)


def key_secret(args: argparse.Namespace) -> bytes:
    """The secret API keys are hashed under, shared by every replica: from
    JETSERVE_KEY_SECRET(_FILE); missing and not --insecure: refuse to start."""
    from gateway.tenancy.keys import INSECURE_KEY_SECRET
    from streams.errors import CredentialError
    from streams.secrets import read_secret

    secret = read_secret(KEY_SECRET_ENV)
    if secret is not None:
        return secret.encode()
    if not args.insecure:
        raise CredentialError(
            f"no key secret: set {KEY_SECRET_ENV}_FILE (or {KEY_SECRET_ENV}) to the secret "
            "API keys are hashed under, the same on every gateway replica, or pass --insecure"
        )
    log.warning(
        "INSECURE: no %s; API keys are hashed under a public development secret, "
        "so a copy of Redis can be brute-forced offline",
        KEY_SECRET_ENV,
    )
    return INSECURE_KEY_SECRET


def config(args: argparse.Namespace) -> GatewayConfig:
    from gateway.config import GatewayConfig
    from gateway.tenancy.pricing import PriceBook, parse_price
    from streams.routes import CoalescePolicy, RoutingPolicy
    from streams.secrets import read_secret

    # The key secret first: a gateway that would store keys weakly never starts.
    secret = key_secret(args)
    token = read_secret("JETSERVE_ADMIN_TOKEN")
    from streams.auth import Role

    return GatewayConfig(
        nats_url=args.nats,
        redis_url=args.redis,
        nats_auth=bus_auth(args, Role.GATEWAY),
        redis_password=redis_password(args, "gateway"),
        redis_cluster=args.redis_cluster,
        models=split_csv(args.models),
        embedding_models=split_csv(args.embedding_models),
        context_lengths=dict(args.context_length),
        default_timeout_s=args.timeout,
        forward_header_prefixes=split_csv(args.forward_header_prefix),
        heartbeat_timeout_s=args.heartbeat_timeout,
        keepalive_s=args.keepalive,
        commit_after_s=args.commit_after,
        resume_grace_s=args.resume_grace,
        max_buffered_frames=args.max_buffered_frames,
        otel_exporter=args.otel_exporter,
        topology=lane_topology(frames_topology(args), args.lanes),
        prices=PriceBook(args.price_version, dict(parse_price(p) for p in args.price)),
        admin_host=args.admin_host,
        metrics_tenants=split_csv(args.metrics_tenants),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        key_secret=secret,
        allow_self_approval=args.allow_self_approval,
        admin_port=args.admin_port,
        admin_token_sha256=hashlib.sha256(token.encode()).hexdigest() if token else None,
        routing=RoutingPolicy(mode=args.routing),
        kv_index=args.kv_index,
        hedge=hedge_policy(args.hedge, args.hedge_max_extra),
        shed=not args.no_shed,
        fair=not args.no_fair,
        settle_grace_s=args.settle_grace,
        sweep_s=args.sweep_every,
        outbox_grace_s=args.outbox_grace,
        outbox_scan_s=args.outbox_scan,
        shutdown_grace_s=args.grace,
        refusal_records_per_s=args.refusal_records_per_s,
        refusal_records_burst=args.refusal_records_burst,
        refusal_summary_s=args.refusal_summary_every,
        rollout_guard_every_s=args.rollout_guard_every,
        depth_reader_renew_s=args.depth_reader_renew,
        evidence_watch_every_s=args.evidence_watch_every,
        idempotency_window_s=args.idempotency_window,
        coalesce=CoalescePolicy(enabled=args.coalesce),
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        client_send_buffer_bytes=args.client_send_buffer,
        request_read_timeout_s=args.request_read_timeout,
        keep_alive_s=args.keep_alive_timeout,
        ws_max_message_bytes=args.ws_max_message_bytes,
        ws_max_inflight=args.ws_max_inflight,
        nats_max_inflight=args.nats_max_inflight,
        nats_max_unauthenticated=args.nats_max_unauthenticated,
        ws_idle_timeout_s=args.ws_idle_timeout,
        ws_send_timeout_s=args.ws_send_timeout,
        ws_ticket_ttl_s=args.ws_ticket_ttl,
        ws_allow_query_key=args.ws_allow_query_key,
    )


def run(args: argparse.Namespace) -> int:
    import uvloop

    from gateway.serve import serve

    cfg = config(args)
    uvloop.run(
        serve(
            cfg,
            args.host,
            args.port,
            log_level=args.log_level,
            grace=args.grace,
            reuse_port=args.reuse_port,
        )
    )
    return 0

"""``jetserve gateway``: the OpenAI-compatible HTTP/SSE/WebSocket + NATS ingress."""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import TYPE_CHECKING

from jetserve.commands.common import (
    DEFAULT_NATS,
    DEFAULT_REDIS,
    OTEL_EXPORTER,
    OTEL_HELP,
    REPLICAS_HELP,
    split_csv,
)

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from jetserve.commands.common import Subparsers
    from streams.routes import HedgePolicy


def register(sub: Subparsers) -> None:
    g = sub.add_parser(
        "gateway", allow_abbrev=False, help="OpenAI-compatible HTTP/SSE/WebSocket + NATS ingress"
    )
    g.add_argument("--nats", default=DEFAULT_NATS)
    g.add_argument("--redis", default=DEFAULT_REDIS)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--otel-exporter", default=OTEL_EXPORTER, help=OTEL_HELP)
    g.add_argument("--replicas", type=int, default=1, help=REPLICAS_HELP)
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--models", default="sim-8b", help="comma-separated chat/completion models")
    g.add_argument("--embedding-models", default="sim-embed")
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
    g.add_argument(
        "--metrics-tenants", default="", help="tenants named in metrics (others: 'other')"
    )
    g.set_defaults(func=run)


def _admin_and_pricing(g: argparse.ArgumentParser) -> None:
    g.add_argument("--admin-host", default="127.0.0.1", help="admin API address (keep private)")
    g.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="admin API port (credential: JETSERVE_ADMIN_TOKEN); off when not set",
    )
    g.add_argument(
        "--price",
        action="append",
        default=[],
        help="MODEL=IN/OUT micro-USD per 1K tokens (repeatable)",
    )
    g.add_argument("--price-version", default="v1")


def _routing(g: argparse.ArgumentParser) -> None:
    g.add_argument("--coalesce", action="store_true", help="share identical T=0 requests")
    g.add_argument(
        "--routing",
        choices=("affinity", "round_robin", "least_loaded"),
        default="affinity",
        help="routing for models without a route contract",
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


def hedge_policy(spec: str | None, max_extra: float) -> HedgePolicy:
    """``--hedge p95|SECONDS`` as a policy; off when not given."""
    from streams.routes import HedgePolicy

    if spec is None:
        return HedgePolicy()
    if spec == "p95":
        return HedgePolicy(enabled=True, delay="p95", max_extra_ratio=max_extra)
    return HedgePolicy(enabled=True, delay=float(spec), max_extra_ratio=max_extra)


def config(args: argparse.Namespace) -> GatewayConfig:
    from gateway.config import GatewayConfig
    from gateway.tenancy.pricing import PriceBook, parse_price
    from streams.definitions import Topology
    from streams.routes import CoalescePolicy, RoutingPolicy

    token = os.environ.get("JETSERVE_ADMIN_TOKEN") or None
    return GatewayConfig(
        nats_url=args.nats,
        redis_url=args.redis,
        models=split_csv(args.models),
        embedding_models=split_csv(args.embedding_models),
        default_timeout_s=args.timeout,
        forward_header_prefixes=split_csv(args.forward_header_prefix),
        heartbeat_timeout_s=args.heartbeat_timeout,
        keepalive_s=args.keepalive,
        commit_after_s=args.commit_after,
        resume_grace_s=args.resume_grace,
        max_buffered_frames=args.max_buffered_frames,
        otel_exporter=args.otel_exporter,
        topology=Topology(replicas=args.replicas),
        prices=PriceBook(args.price_version, dict(parse_price(p) for p in args.price)),
        admin_host=args.admin_host,
        metrics_tenants=split_csv(args.metrics_tenants),
        admin_port=args.admin_port,
        admin_token_sha256=hashlib.sha256(token.encode()).hexdigest() if token else None,
        routing=RoutingPolicy(mode=args.routing),
        hedge=hedge_policy(args.hedge, args.hedge_max_extra),
        shed=not args.no_shed,
        coalesce=CoalescePolicy(enabled=args.coalesce),
    )


def run(args: argparse.Namespace) -> int:
    import uvloop

    from gateway.serve import serve

    cfg = config(args)
    uvloop.run(serve(cfg, args.host, args.port, log_level=args.log_level, grace=args.grace))
    return 0

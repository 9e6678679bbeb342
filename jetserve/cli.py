"""The ``jetserve`` console script: the composition root, the one place that
imports every package."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import uvloop

from jetserve.admin_client import AdminClient, AdminError

DEFAULT_NATS = os.environ.get("JETSERVE_NATS_URL", "nats://127.0.0.1:4222")
DEFAULT_REDIS = os.environ.get("JETSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_ADMIN = os.environ.get("JETSERVE_ADMIN_URL", "http://127.0.0.1:8081")
OTEL_EXPORTER = os.environ.get("JETSERVE_OTEL_EXPORTER") or None
OTEL_HELP = "export spans: otlp+http://HOST:4318 or file:///PATH (needs the otel extra)"


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _hedge_policy(spec: str | None, max_extra: float) -> Any:
    from streams.routes import HedgePolicy

    if spec is None:
        return HedgePolicy()
    delay: Any = spec if spec == "p95" else float(spec)
    return HedgePolicy(enabled=True, delay=delay, max_extra_ratio=max_extra)


def cmd_gateway(args: argparse.Namespace) -> int:
    import hashlib

    from gateway.config import GatewayConfig
    from gateway.serve import serve
    from gateway.tenancy.pricing import PriceBook, parse_price
    from streams.definitions import Topology
    from streams.routes import CoalescePolicy, RoutingPolicy

    token = os.environ.get("JETSERVE_ADMIN_TOKEN") or None
    cfg = GatewayConfig(
        nats_url=args.nats,
        redis_url=args.redis,
        models=_csv(args.models),
        embedding_models=_csv(args.embedding_models),
        default_timeout_s=args.timeout,
        forward_header_prefixes=_csv(args.forward_header_prefix),
        heartbeat_timeout_s=args.heartbeat_timeout,
        keepalive_s=args.keepalive,
        commit_after_s=args.commit_after,
        resume_grace_s=args.resume_grace,
        max_buffered_frames=args.max_buffered_frames,
        otel_exporter=args.otel_exporter,
        topology=Topology(replicas=args.replicas),
        prices=PriceBook(args.price_version, dict(parse_price(p) for p in args.price)),
        admin_host=args.admin_host,
        metrics_tenants=_csv(args.metrics_tenants),
        admin_port=args.admin_port,
        admin_token_sha256=hashlib.sha256(token.encode()).hexdigest() if token else None,
        routing=RoutingPolicy(mode=args.routing),
        hedge=_hedge_policy(args.hedge, args.hedge_max_extra),
        shed=not args.no_shed,
        coalesce=CoalescePolicy(enabled=args.coalesce),
    )
    uvloop.run(serve(cfg, args.host, args.port, log_level=args.log_level, grace=args.grace))
    return 0


async def _run_worker(args: argparse.Namespace) -> int:
    from streams.definitions import Topology
    from streams.subjects import RequestClass
    from workers.engines.factory import make_adapter
    from workers.inference.admission import AdmissionConfig
    from workers.inference.worker import Worker, WorkerConfig

    kwargs = {"worker_id": args.worker_id} if args.worker_id else {}
    cfg = WorkerConfig(
        nats_url=args.nats,
        classes=tuple(RequestClass(c) for c in _csv(args.classes)),
        admission=AdmissionConfig(max_inflight=args.max_inflight, target_util=args.target_util),
        heartbeat_s=args.heartbeat,
        drain_timeout_s=args.grace,
        otel_exporter=args.otel_exporter,
        embed_batch_max=args.embed_batch_max,
        embed_batch_delay_ms=args.embed_batch_delay_ms,
        topology=Topology(replicas=args.replicas),
        deployment=await _worker_deployment(args),
        **kwargs,
    )
    model = args.deployment_name  # names the model in Triton's URL
    async with make_adapter(args.dialect, args.engine, args.engine_api_key, model) as engine:
        worker = Worker(cfg, engine)
        loop = asyncio.get_running_loop()
        http = None
        if args.metrics_port is not None:
            from workers.probe import server

            http = server(worker, args.metrics_host, args.metrics_port)
        async with asyncio.TaskGroup() as tg:
            http_task = tg.create_task(http.serve()) if http is not None else None

            def stop() -> None:
                tg.create_task(worker.shutdown())

            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop)
            await worker.run()
            if http is not None and http_task is not None:
                http.should_exit = True
    return 0


async def _worker_deployment(args: argparse.Namespace) -> Any:
    """The route deployment a worker declares (``streams.routes.Deployment``).
    Unset flags come from the engine: name and model = the model it serves,
    engine = its ``owned_by``; None when the engine can't say (then the worker
    serves only requests whose route lists no candidates)."""
    import httpx

    from streams.routes import Deployment

    name, engine, model = args.deployment_name, args.deployment_engine, args.deployment_name
    if not (name and engine):
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                r = await client.get(f"{args.engine.rstrip('/')}/v1/models")
                r.raise_for_status()
                first = r.json()["data"][0]
            model = model or str(first["id"])
            name, engine = name or model, engine or str(first.get("owned_by") or "unknown")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            if not name:
                logging.getLogger("jetserve.worker").warning(
                    "no --deployment-name and the engine did not name its model (%s): "
                    "this worker serves no route with candidates",
                    exc,
                )
                return None
            engine = engine or "unknown"
    dialect = getattr(args, "dialect", None)
    return Deployment(
        name=name,
        adapter=dialect if dialect in ("openai", "tgi", "triton") else "openai",
        engine=engine,
        model=model or name,
        hardware=args.deployment_hardware,
        precision=args.deployment_precision,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    return uvloop.run(_run_worker(args))


async def _run_agent(args: argparse.Namespace) -> int:
    import redis.asyncio as redis

    from streams.agent_topology import AgentTopology
    from streams.definitions import Topology
    from tools import Registry, ToolContext
    from workers.agent import CrashPoints, Executor, ExecutorConfig, parse_crash_specs
    from workers.agent.demo_tools import DemoBank, demo_tools

    crash = CrashPoints(parse_crash_specs(args.crash_at), args.crash_log)
    registry = Registry()
    client: redis.Redis | None = None
    if args.demo_tools:

        def hook(point: str, ctx: ToolContext) -> None:
            crash.maybe(point, ctx.run_id, ctx.step, ctx.call_id)

        client = redis.Redis.from_url(args.redis)
        for tool in demo_tools(DemoBank(client, hook=hook)):
            registry.register(tool)
    for spec in args.tools_module:
        for tool in _load_tools(spec):
            registry.register(tool)
    kwargs = {"executor_id": args.executor_id} if args.executor_id else {}
    cfg = ExecutorConfig(
        nats_url=args.nats,
        concurrency=args.concurrency,
        lease_s=args.lease,
        step_timeout_s=args.step_timeout,
        stuck_policy=args.stuck,
        stuck_retries=args.stuck_retries,
        heartbeat_timeout_s=args.heartbeat_timeout,
        model_attempts=args.model_attempts,
        step_max_tokens=args.step_max_tokens,
        max_depth=args.max_depth,
        drain_timeout_s=args.grace,
        agent=AgentTopology(ack_wait_s=args.ack_wait, replicas=args.replicas),
        topology=Topology(replicas=args.replicas),
        **kwargs,
    )
    executor = Executor(cfg, registry, crash=crash)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, executor.request_stop)
    http = None
    if args.metrics_port is not None:
        from workers.agent.http import server

        http = server(executor, args.metrics_host, args.metrics_port)
    try:
        async with asyncio.TaskGroup() as tg:
            if http is not None:
                tg.create_task(http.serve())
            await executor.run()
            if http is not None:
                http.should_exit = True
    finally:
        if client is not None:
            await client.aclose()
    return 0


def _load_tools(spec: str) -> list[Any]:
    """``pkg.module:factory`` -> the tools ``factory()`` returns (an iterable of
    ``tools.Tool``: in-process functions or ``Remote`` NATS services)."""
    import importlib

    module, _, name = spec.partition(":")
    if not module or not name:
        raise SystemExit(f"--tools-module {spec!r}: expected pkg.module:factory")
    factory = getattr(importlib.import_module(module), name)
    return list(factory())


def cmd_agent(args: argparse.Namespace) -> int:
    return uvloop.run(_run_agent(args))


def cmd_sim(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from sim.cli import main as sim_main

    return sim_main(list(rest))


def _admin(args: argparse.Namespace) -> AdminClient:
    token = args.admin_token or os.environ.get("JETSERVE_ADMIN_TOKEN")
    if not token:
        raise SystemExit("the admin API needs a token: --admin-token or JETSERVE_ADMIN_TOKEN")
    return AdminClient(args.admin_url, token)


def _show(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _scopes(args: argparse.Namespace) -> dict[str, list[str]]:
    return {
        name: list(_csv(value))
        for name in ("models", "classes", "tools", "data_classes")
        if (value := getattr(args, name, None))
    }


def cmd_admin(args: argparse.Namespace) -> int:
    try:
        return _admin_command(args)
    except AdminError as exc:
        print(f"jetserve {args.cmd}: {exc}", file=sys.stderr)
        return 1


def _admin_command(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        what = (args.cmd, getattr(args, "action", ""))
        if what == ("tenants", "create"):
            _show(admin.create_tenant(args.tenant, args.org or "", args.name))
        elif what == ("tenants", "list"):
            _show(admin.list_tenants())
        elif what == ("tenants", "show"):
            _show(admin.show_tenant(args.tenant))
        elif what == ("keys", "create"):
            if args.create_tenant:
                try:
                    admin.create_tenant(args.tenant)
                except AdminError as exc:
                    if exc.status != 409:  # it exists already: fine
                        raise
            created = admin.create_key(args.tenant, args.name, _scopes(args), args.key)
            _show(created["key"])
            print(f"api_key: {created['api_key']}   (shown once; only its hash is stored)")
        elif what == ("keys", "list"):
            _show(admin.list_keys(args.tenant))
        elif what == ("keys", "rotate"):
            created = admin.rotate_key(args.key_id)
            _show(created["key"])
            print(f"api_key: {created['api_key']}   (shown once; the old key is revoked)")
        elif what == ("keys", "revoke"):
            _show(admin.revoke_key(args.key_id))
        elif what == ("limits", "set"):
            # Only the flags given change; the others keep their current value.
            current = admin.get_limits(args.level, args.id)
            limits = {k: current.get(k) for k in ("budget_micros", "period", "rpm", "tpm")}
            if args.budget_usd is not None:
                limits["budget_micros"] = round(args.budget_usd * 1_000_000)
            for name in ("period", "rpm", "tpm"):
                if getattr(args, name) is not None:
                    limits[name] = getattr(args, name)
            _show(admin.set_limits(args.level, args.id, **limits))
        elif what == ("limits", "show"):
            _show(admin.get_limits(args.level, args.id))
        elif args.cmd == "routes":
            from jetserve.routes_cli import routes_command

            routes_command(admin, args)
        elif args.cmd == "ledger":
            text = admin.ledger(args.tenant, args.since, args.until)
            if args.out:
                with open(args.out, "w") as fh:
                    fh.write(text)
                print(f"wrote {text.count(chr(10))} records to {args.out}")
            else:
                sys.stdout.write(text)
        else:  # pragma: no cover - argparse enforces the choices
            raise SystemExit(f"unknown command {what}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from jetserve.scale import run_scale

    return run_scale(args)


def cmd_up(args: argparse.Namespace) -> int:
    from jetserve.up import run_up

    return run_up(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from jetserve.bench.cli import main as bench_main

    return bench_main(args.bench_args)


def cmd_conformance(args: argparse.Namespace) -> int:
    from jetserve.conformance.cli import main as conformance

    return conformance(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetserve", description=__doc__, allow_abbrev=False)
    p.add_argument("--log-level", default="warning")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser(
        "gateway", allow_abbrev=False, help="OpenAI-compatible HTTP/SSE/WebSocket + NATS ingress"
    )
    g.add_argument("--nats", default=DEFAULT_NATS)
    g.add_argument("--redis", default=DEFAULT_REDIS)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--otel-exporter", default=OTEL_EXPORTER, help=OTEL_HELP)
    g.add_argument("--replicas", type=int, default=1, help="JetStream stream replicas (3: HA)")
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
    g.add_argument(
        "--metrics-tenants", default="", help="tenants named in metrics (others: 'other')"
    )
    g.set_defaults(func=cmd_gateway)

    w = sub.add_parser(
        "worker", allow_abbrev=False, help="inference worker: pulls requests, calls an engine"
    )
    w.add_argument("--nats", default=DEFAULT_NATS)
    w.add_argument("--engine", default="http://127.0.0.1:8100", help="OpenAI-compatible base URL")
    w.add_argument("--engine-api-key", default=None)
    w.add_argument(
        "--engine-dialect",
        dest="dialect",
        default="openai",
        choices=["openai", "tgi", "triton"],
        help="engine API; triton needs --deployment-name (the model)",
    )
    w.add_argument("--otel-exporter", default=OTEL_EXPORTER, help=OTEL_HELP)
    w.add_argument("--replicas", type=int, default=1, help="JetStream stream replicas (3: HA)")
    w.add_argument("--classes", default="interactive,agent,embed,batch", help="in priority order")
    w.add_argument("--max-inflight", type=int, default=16, help="the engine's max_num_seqs")
    w.add_argument("--target-util", type=float, default=0.9, help="KV cache target utilisation")
    w.add_argument("--heartbeat", type=float, default=1.0)
    w.add_argument("--worker-id", default="")
    w.add_argument("--grace", type=float, default=30.0, help="drain timeout on SIGTERM (s)")
    w.add_argument("--metrics-port", type=int, default=None, help="serve /metrics and /readyz")
    w.add_argument("--metrics-host", default="127.0.0.1")
    w.add_argument("--deployment-name", default="", help="route deployment served (default: model)")
    w.add_argument("--deployment-engine", default="", help="default: the engine's owned_by")
    w.add_argument("--deployment-hardware", default="unspecified")
    w.add_argument("--deployment-precision", default="bf16")
    w.add_argument("--embed-batch-max", type=int, default=32, help="inputs per engine call")
    w.add_argument("--embed-batch-delay-ms", type=float, default=5.0, help="batch fill wait")
    w.set_defaults(func=cmd_worker)

    a = sub.add_parser(
        "agent", allow_abbrev=False, help="agent run executor: steps runs, dispatches tools"
    )
    a.add_argument("--nats", default=DEFAULT_NATS)
    a.add_argument("--redis", default=DEFAULT_REDIS, help="the demo tools' bank")
    a.add_argument("--executor-id", default="")
    a.add_argument("--concurrency", type=int, default=64, help="steps in flight")
    a.add_argument("--lease", type=float, default=5.0, help="run lease (s), renewed at 1/3")
    a.add_argument("--ack-wait", type=float, default=5.0, help="step consumer ack_wait (s)")
    a.add_argument(
        "--step-timeout", type=float, default=300.0, help="a step past this is stuck (s)"
    )
    a.add_argument("--stuck", choices=["fail", "retry"], default="fail", help="stuck policy")
    a.add_argument("--stuck-retries", type=int, default=2)
    a.add_argument("--heartbeat-timeout", type=float, default=5.0)
    a.add_argument("--model-attempts", type=int, default=3)
    a.add_argument("--step-max-tokens", type=int, default=1024)
    a.add_argument("--max-depth", type=int, default=3, help="sub-agent nesting")
    a.add_argument("--replicas", type=int, default=1, help="JetStream stream replicas (3: HA)")
    a.add_argument("--grace", type=float, default=10.0, help="drain timeout on SIGTERM (s)")
    a.add_argument(
        "--demo-tools", action="store_true", help="transfer, payout, balance, sleep (Redis)"
    )
    a.add_argument(
        "--tools-module",
        action="append",
        default=[],
        metavar="MODULE:FACTORY",
        help="register the tools FACTORY() returns (repeatable)",
    )
    a.add_argument(
        "--crash-at",
        action="append",
        default=[],
        metavar="POINT:PROBABILITY",
        help="tests: SIGKILL self at a step point (repeatable)",
    )
    a.add_argument("--crash-log", default=None, help="tests: append each self-kill here")
    a.add_argument("--metrics-port", type=int, default=None, help="serve /metrics and /readyz")
    a.add_argument("--metrics-host", default="127.0.0.1")
    a.set_defaults(func=cmd_agent)

    s = sub.add_parser(
        "sim", allow_abbrev=False, help="the vLLM-like engine simulator", add_help=False
    )
    s.set_defaults(func=None)

    def admin_parser(name: str, help_text: str) -> argparse._SubParsersAction[Any]:
        ap = sub.add_parser(name, allow_abbrev=False, help=help_text)
        ap.set_defaults(func=cmd_admin)
        return ap.add_subparsers(dest="action", required=True)

    def admin_opts(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
        ap.add_argument("--admin-url", default=DEFAULT_ADMIN)
        ap.add_argument("--admin-token", default=None, help="default: $JETSERVE_ADMIN_TOKEN")
        return ap

    t = admin_parser("tenants", "tenants (admin API)")
    tc = admin_opts(t.add_parser("create", allow_abbrev=False))
    tc.add_argument("tenant")
    tc.add_argument("--org", default=None, help="default: an org named like the tenant")
    tc.add_argument("--name", default="")
    admin_opts(t.add_parser("list", allow_abbrev=False))
    admin_opts(t.add_parser("show", allow_abbrev=False)).add_argument("tenant")

    k = admin_parser("keys", "API keys (admin API)")
    kc = admin_opts(k.add_parser("create", allow_abbrev=False))
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--name", default="")
    kc.add_argument("--models", default=None, help="comma-separated; default any")
    kc.add_argument("--classes", default=None, help="comma-separated; default any")
    kc.add_argument("--tools", default=None)
    kc.add_argument("--data-classes", dest="data_classes", default=None)
    kc.add_argument("--key", default=None, help="use this plaintext (demos only)")
    kc.add_argument("--create-tenant", action="store_true", help="create the tenant if missing")
    admin_opts(k.add_parser("list", allow_abbrev=False)).add_argument("--tenant", required=True)
    admin_opts(k.add_parser("rotate", allow_abbrev=False)).add_argument("key_id")
    admin_opts(k.add_parser("revoke", allow_abbrev=False)).add_argument("key_id")

    lim = admin_parser("limits", "budgets and rate limits (admin API)")
    ls = admin_opts(lim.add_parser("set", allow_abbrev=False))
    ls.add_argument("--level", choices=["org", "tenant", "key"], required=True)
    ls.add_argument("--id", required=True)
    ls.add_argument("--budget-usd", type=float, default=None)
    ls.add_argument("--period", choices=["day", "month", "total"], default=None)
    ls.add_argument("--rpm", type=int, default=None)
    ls.add_argument("--tpm", type=int, default=None)
    lsh = admin_opts(lim.add_parser("show", allow_abbrev=False))
    lsh.add_argument("--level", choices=["org", "tenant", "key"], required=True)
    lsh.add_argument("--id", required=True)

    led = admin_opts(sub.add_parser("ledger", allow_abbrev=False, help="query/export the ledger"))
    led.add_argument("--tenant", required=True)
    led.add_argument("--since", type=float, default=None, help="unix seconds")
    led.add_argument("--until", type=float, default=None, help="unix seconds")
    led.add_argument("--out", default=None, help="write JSONL here (default: stdout)")
    led.set_defaults(func=cmd_admin)

    from jetserve.routes_cli import add_routes_parser

    add_routes_parser(admin_parser("routes", "route contracts (admin API)"), admin_opts)

    sc = sub.add_parser(
        "scale",
        allow_abbrev=False,
        help="queue lag per class and the worker count KEDA will choose",
    )
    sc.add_argument("--nats", default=DEFAULT_NATS, help="read the consumers through this server")
    sc.add_argument(
        "--monitoring",
        default=None,
        metavar="HOST:PORT",
        help="read /jsz here instead, as KEDA does (its natsServerMonitoringEndpoint)",
    )
    sc.add_argument("--account", default="$G", help="the NATS account /jsz is asked for")
    sc.add_argument("--classes", default="interactive,embed,batch")
    per_class = "N or CLASS=N, comma-separated, repeatable"
    sc.add_argument(
        "--max-inflight", action="append", default=[], help=f"worker concurrency ({per_class})"
    )
    sc.add_argument(
        "--target-per-worker",
        action="append",
        default=[],
        help=f"KEDA lagThreshold; default: --max-inflight ({per_class})",
    )
    sc.add_argument(
        "--activation-lag",
        action="append",
        default=[],
        help=f"activationLagThreshold ({per_class})",
    )
    sc.add_argument(
        "--min-replicas", action="append", default=[], help=f"minReplicaCount ({per_class})"
    )
    sc.add_argument(
        "--max-replicas", action="append", default=[], help=f"maxReplicaCount ({per_class})"
    )
    sc.add_argument(
        "--replicas",
        action="append",
        default=[],
        help=f"current replicas, for the HPA's 10%% tolerance ({per_class})",
    )
    sc.add_argument("--json", action="store_true", help="print JSON (one line per refresh)")
    sc.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh")
    sc.set_defaults(func=cmd_scale)

    u = sub.add_parser("up", allow_abbrev=False, help="run the whole fleet on loopback")
    u.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    u.add_argument("--api-key", default=None, help="demo key (default: a fresh random one)")
    u.add_argument("--workers", type=int, default=2)
    u.add_argument("--profile", default="h100-8b", help="simulator latency profile")
    u.add_argument("--check", action="store_true", help="run the self-check, then stop")
    u.set_defaults(func=cmd_up)

    # Every flag after `bench` belongs to jetserve.bench.cli: an unmatchable prefix
    # char keeps argparse from reading them as this parser's options.
    b = sub.add_parser(
        "bench",
        allow_abbrev=False,
        add_help=False,
        prefix_chars="\x00",
        help="open-loop benchmarks, side by side (jetserve bench --help)",
    )
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)

    from jetserve.conformance.cli import add_arguments

    cf = sub.add_parser("conformance", allow_abbrev=False, help="adapter translation-loss report")
    add_arguments(cf)
    cf.set_defaults(func=cmd_conformance)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `sim` owns its own flags: hand everything after it to the simulator's parser.
    head = argv
    if head[:1] == ["--log-level"]:
        head = head[2:]
    elif head and head[0].startswith("--log-level="):
        head = head[1:]
    if head[:1] == ["sim"]:
        return cmd_sim(argparse.Namespace(), head[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    result: int = args.func(args)
    return result

"""The ``jetserve`` console script: the composition root, the one place that
imports every package."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

import uvloop

DEFAULT_NATS = os.environ.get("JETSERVE_NATS_URL", "nats://127.0.0.1:4222")
DEFAULT_REDIS = os.environ.get("JETSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.config import GatewayConfig

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
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(cfg),
            host=args.host,
            port=args.port,
            loop="uvloop",
            http="httptools",
            ws="websockets",
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=args.grace,
        )
    )
    server.run()
    return 0


async def _run_worker(args: argparse.Namespace) -> int:
    from streams.subjects import RequestClass
    from workers.admission import AdmissionConfig
    from workers.engines.openai import OpenAIAdapter
    from workers.worker import Worker, WorkerConfig

    kwargs = {"worker_id": args.worker_id} if args.worker_id else {}
    cfg = WorkerConfig(
        nats_url=args.nats,
        classes=tuple(RequestClass(c) for c in _csv(args.classes)),
        admission=AdmissionConfig(max_inflight=args.max_inflight, target_util=args.target_util),
        heartbeat_s=args.heartbeat,
        drain_timeout_s=args.grace,
        **kwargs,
    )
    async with OpenAIAdapter(args.engine, api_key=args.engine_api_key) as engine:
        worker = Worker(cfg, engine)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.shutdown()))
        await worker.run()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    return uvloop.run(_run_worker(args))


def cmd_sim(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from workers.sim.cli import main as sim_main

    return sim_main(list(rest))


async def _keys_create(args: argparse.Namespace) -> int:
    import redis.asyncio as redis

    from gateway.keys import KeyStore

    rds = redis.Redis.from_url(args.redis)
    try:
        key, record = await KeyStore(rds).create(args.tenant, args.key)
    finally:
        await rds.aclose()
    print(f"key_id={record.key_id} tenant={record.tenant}")
    print(f"api_key={key}   (shown once; only its hash is stored)")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    return uvloop.run(_keys_create(args))


def cmd_up(args: argparse.Namespace) -> int:
    from jetserve.up import run_up

    return run_up(args)


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
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--models", default="sim-8b", help="comma-separated chat/completion models")
    g.add_argument("--embedding-models", default="sim-embed")
    g.add_argument("--timeout", type=float, default=120.0, help="default request deadline (s)")
    g.add_argument("--heartbeat-timeout", type=float, default=3.0)
    g.add_argument("--keepalive", type=float, default=10.0, help="SSE keep-alive interval (s)")
    g.add_argument(
        "--commit-after", type=float, default=5.0, help="send stream headers after this wait (s)"
    )
    g.add_argument("--forward-header-prefix", default="", help="engine headers allowed through")
    g.add_argument("--grace", type=float, default=30.0, help="graceful shutdown (s)")
    g.set_defaults(func=cmd_gateway)

    w = sub.add_parser(
        "worker", allow_abbrev=False, help="inference worker: pulls requests, calls an engine"
    )
    w.add_argument("--nats", default=DEFAULT_NATS)
    w.add_argument("--engine", default="http://127.0.0.1:8100", help="OpenAI-compatible base URL")
    w.add_argument("--engine-api-key", default=None)
    w.add_argument("--classes", default="interactive,embed,batch", help="in priority order")
    w.add_argument("--max-inflight", type=int, default=16, help="the engine's max_num_seqs")
    w.add_argument("--target-util", type=float, default=0.9, help="KV cache target utilisation")
    w.add_argument("--heartbeat", type=float, default=1.0)
    w.add_argument("--worker-id", default="")
    w.add_argument("--grace", type=float, default=30.0, help="drain timeout on SIGTERM (s)")
    w.set_defaults(func=cmd_worker)

    s = sub.add_parser(
        "sim", allow_abbrev=False, help="the vLLM-like engine simulator", add_help=False
    )
    s.set_defaults(func=None)

    k = sub.add_parser("keys", allow_abbrev=False, help="API keys")
    ksub = k.add_subparsers(dest="keys_cmd", required=True)
    kc = ksub.add_parser("create", allow_abbrev=False, help="create a key for a tenant")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--key", default=None, help="use this plaintext (demos only)")
    kc.add_argument("--redis", default=DEFAULT_REDIS)
    kc.set_defaults(func=cmd_keys)

    u = sub.add_parser("up", allow_abbrev=False, help="run the whole fleet on loopback")
    u.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    u.add_argument("--api-key", default=None, help="demo key (default: a fresh random one)")
    u.add_argument("--workers", type=int, default=2)
    u.add_argument("--profile", default="h100-8b", help="simulator latency profile")
    u.add_argument("--check", action="store_true", help="run the self-check, then stop")
    u.set_defaults(func=cmd_up)
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

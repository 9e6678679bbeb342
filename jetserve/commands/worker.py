"""``jetserve worker``: the inference worker; pulls requests, calls an engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import TYPE_CHECKING

from jetserve.commands.common import (
    DEFAULT_NATS,
    OTEL_EXPORTER,
    OTEL_HELP,
    REPLICAS_HELP,
    add_bus_args,
    bus_auth,
    engine_api_key,
    split_csv,
)

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers
    from streams.membership import Adapter
    from streams.routes import Deployment
    from workers.inference.worker import WorkerConfig

DEFAULT_ENGINE = "http://127.0.0.1:8100"


def register(sub: Subparsers) -> None:
    w = sub.add_parser(
        "worker", allow_abbrev=False, help="inference worker: pulls requests, calls an engine"
    )
    w.add_argument("--nats", default=DEFAULT_NATS)
    add_bus_args(w)
    w.add_argument(
        "--engine",
        dest="engines",
        action="append",
        default=[],
        metavar="URL",
        help="OpenAI-compatible base URL (default http://127.0.0.1:8100); repeat it to drive "
        "several engines from one process: each is a replica of its own (worker id "
        "<id>-<n>, admission, lanes; its metrics labelled replica=<id>-<n>). An API key "
        "the engine checks: JETSERVE_ENGINE_API_KEY (or _FILE), never a flag",
    )
    w.add_argument(
        "--kv-events",
        dest="kv_events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="the engine's KV cache events (vLLM --kv-events-config's ZMQ endpoint, e.g. "
        "tcp://127.0.0.1:5557), fed to the fleet's KV index (gateway --kv-index); one per "
        "--engine, in the same order",
    )
    w.add_argument("--kv-events-topic", default="", help="the events' ZMQ topic (prefix)")
    w.add_argument(
        "--engine-dialect",
        dest="dialect",
        default="openai",
        choices=["openai", "llamacpp", "tgi", "triton"],
        help="engine API; triton needs --deployment-name (the model)",
    )
    w.add_argument(
        "--engine-context-length",
        type=int,
        default=None,
        help="llamacpp: the server's --n_ctx (it clips a longer max_tokens silently; "
        "known, the adapter refuses it with 400 as vLLM does)",
    )
    w.add_argument("--otel-exporter", default=OTEL_EXPORTER, help=OTEL_HELP)
    w.add_argument("--replicas", type=int, default=1, help=REPLICAS_HELP)
    w.add_argument("--classes", default="interactive,agent,embed,batch", help="in priority order")
    w.add_argument("--max-inflight", type=int, default=16, help="the engine's max_num_seqs")
    w.add_argument(
        "--lower-share",
        type=float,
        default=0.05,
        help="the lower classes' share of the slots under contention, averaged over 10 s "
        "(at most that share of --max-inflight at once, at least one): batch progresses, "
        "interactive comes first (docs/routing.md)",
    )
    w.add_argument(
        "--starve-after",
        type=float,
        default=1.0,
        help="seconds a lower class is held back while interactive asks for slots, before "
        "it takes its floor (--lower-share) anyway",
    )
    w.add_argument(
        "--in-turn-spare",
        type=int,
        default=None,
        help="slots a class's excess (a flooding tenant) leaves free beyond the one kept for "
        "tenants in turn (default: --max-inflight // 16)",
    )
    w.add_argument(
        "--lane-depth",
        type=int,
        default=4,  # streams.rendezvous.DEFAULT_DEPTH (not imported: the CLI starts light)
        help="the workers each lane is pulled by: its owner and depth-1 backups (spill, failover)",
    )
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
    w.add_argument(
        "--embed-batching",
        choices=["auto", "on", "off"],
        default="auto",
        help="embedding micro-batching; auto: on only for an engine that runs each call "
        "alone (the simulator), off for one that batches concurrent calls itself (vLLM) "
        "(docs/batching.md)",
    )
    w.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the model's tokenizer.json, or its directory: a batched embedding call's usage "
        "is split per request by counting in-process, not by one engine /tokenize call per "
        "input (needs the `embed` extra: the tokenizers package)",
    )
    w.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import dataclasses
    import uuid

    from streams.tasks import install_task_dump
    from workers.engines.factory import make_adapter
    from workers.errors import TokenizerUnavailable
    from workers.inference.worker import Worker
    from workers.probe import probe_server
    from workers.replicas import all_ready, replica_registry

    engines = args.engines or [DEFAULT_ENGINE]
    if args.kv_events and len(args.kv_events) != len(engines):
        print("jetserve worker: one --kv-events per --engine", file=sys.stderr)
        return 2
    base_id = args.worker_id or f"w-{uuid.uuid4().hex[:8]}"
    model = args.deployment_name  # names the model in Triton's URL
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for n, url in enumerate(engines):
            # One replica per engine: its own id (lane ownership), admission and metrics.
            worker_id = base_id if len(engines) == 1 else f"{base_id}-{n}"
            cfg = dataclasses.replace(
                await worker_config(args, url),
                worker_id=worker_id,
                kv_events=args.kv_events[n] if args.kv_events else None,
                kv_events_topic=args.kv_events_topic,
            )
            engine = await stack.enter_async_context(
                make_adapter(args.dialect, url, engine_api_key(), model, args.engine_context_length)
            )
            try:
                workers.append(Worker(cfg, engine))
            except TokenizerUnavailable as exc:
                print(f"jetserve worker: {exc}", file=sys.stderr)
                return 2
        http = None
        if args.metrics_port is not None:
            if len(workers) == 1:
                http = workers[0].probe(args.metrics_host, args.metrics_port)
            else:
                replicas = [(w.cfg.worker_id, w.metrics.registry) for w in workers]
                registry = replica_registry(replicas)
                ready = all_ready([w.checks for w in workers])
                http = probe_server(registry, ready, args.metrics_host, args.metrics_port)
        async with asyncio.TaskGroup() as tg:
            if http is not None:
                tg.create_task(http.serve())

            def stop() -> None:
                for worker in workers:
                    tg.create_task(worker.shutdown())

            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop)
            install_task_dump(logging.getLogger("jetserve.worker"))
            async with asyncio.TaskGroup() as serving:
                for worker in workers:
                    serving.create_task(worker.run())
            if http is not None:
                http.should_exit = True
    return 0


async def worker_config(args: argparse.Namespace, engine_url: str) -> WorkerConfig:
    from streams.auth import Role
    from streams.definitions import Topology
    from streams.subjects import RequestClass
    from workers.inference.admission import AdmissionConfig
    from workers.inference.worker import WorkerConfig

    cards = await engine_models(engine_url)
    models, adapters = served(cards)
    return WorkerConfig(
        nats_url=args.nats,
        nats_auth=bus_auth(args, Role.WORKER),
        classes=tuple(RequestClass(c) for c in split_csv(args.classes)),
        admission=AdmissionConfig(
            max_inflight=args.max_inflight,
            target_util=args.target_util,
            lower_share=args.lower_share,
            starve_after=args.starve_after,
            in_turn_spare=args.in_turn_spare,
        ),
        heartbeat_s=args.heartbeat,
        drain_timeout_s=args.grace,
        otel_exporter=args.otel_exporter,
        embed_batch_max=args.embed_batch_max,
        embed_batch_delay_ms=args.embed_batch_delay_ms,
        embed_batching=args.embed_batching,
        tokenizer=args.tokenizer,
        topology=Topology(replicas=args.replicas),
        lane_depth=args.lane_depth,
        deployment=await deployment(args, engine_url, cards),
        models=models,
        adapters=adapters,
    )


async def engine_models(engine_url: str) -> list[dict[str, object]] | None:
    """The engine's /v1/models cards; None when it cannot say."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            r = await client.get(f"{engine_url.rstrip('/')}/v1/models")
            r.raise_for_status()
            cards = r.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        logging.getLogger("jetserve.worker").info("the engine's /v1/models: %r", exc)
        return None
    if not isinstance(cards, list):
        return None
    return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]


def served(cards: list[dict[str, object]] | None) -> tuple[tuple[str, ...], tuple[Adapter, ...]]:
    """The base model ids and the LoRA adapters in an engine's /v1/models cards."""
    from workers.engines.served import parse_cards

    return parse_cards(cards)


async def deployment(
    args: argparse.Namespace, engine_url: str, cards: list[dict[str, object]] | None
) -> Deployment | None:
    """The route deployment a worker declares. Unset flags come from the engine's
    cards: name and model = the (first base) model it serves, engine = its
    ``owned_by``; None when the engine can't say (then the worker serves only
    requests whose route lists no candidates)."""
    from streams.routes import Deployment

    name, engine, model = args.deployment_name, args.deployment_engine, args.deployment_name
    base = [c for c in cards or () if not c.get("parent") or c.get("parent") == c["id"]]
    if not (name and engine):
        if base:
            model = model or str(base[0]["id"])
            name, engine = name or model, engine or str(base[0].get("owned_by") or "unknown")
        elif not name:
            logging.getLogger("jetserve.worker").warning(
                "no --deployment-name and the engine did not name its model: "
                "this worker serves no route with candidates"
            )
            return None
        else:
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

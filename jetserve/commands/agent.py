"""``jetserve agent``: the agent run executor; steps runs, dispatches tools."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from jetserve.commands.common import (
    DEFAULT_NATS,
    DEFAULT_REDIS,
    REDIS_CLUSTER_HELP,
    REPLICAS_HELP,
    add_bus_args,
    bus_auth,
    redis_password,
)

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers
    from streams.redis_client import RedisClient
    from tools import Registry, Tool
    from workers.agent import CrashPoints


def register(sub: Subparsers) -> None:
    a = sub.add_parser(
        "agent", allow_abbrev=False, help="agent run executor: steps runs, dispatches tools"
    )
    a.add_argument("--nats", default=DEFAULT_NATS)
    add_bus_args(a)
    a.add_argument("--redis", default=DEFAULT_REDIS, help="the demo tools' bank")
    a.add_argument("--redis-cluster", action="store_true", help=REDIS_CLUSTER_HELP)
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
    a.add_argument("--replicas", type=int, default=1, help=REPLICAS_HELP)
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
    a.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from streams.agent_topology import AgentTopology
    from streams.auth import Role
    from streams.definitions import Topology
    from streams.redis_client import open_redis
    from streams.tasks import install_task_dump
    from tools import Registry
    from workers.agent import CrashPoints, Executor, ExecutorConfig, parse_crash_specs

    crash = CrashPoints(parse_crash_specs(args.crash_at), args.crash_log)
    registry = Registry()
    client = None
    if args.demo_tools:  # the bank's own Redis ACL user ("agent": demobank:* only)
        client = open_redis(
            args.redis, password=redis_password(args, "agent"), cluster=args.redis_cluster
        )
    if client is not None:
        _register_demo_tools(registry, client, crash)
    for spec in args.tools_module:
        for tool in load_tools(spec):
            registry.register(tool)
    kwargs = {"executor_id": args.executor_id} if args.executor_id else {}
    cfg = ExecutorConfig(
        nats_url=args.nats,
        nats_auth=bus_auth(args, Role.AGENT),
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
    install_task_dump(logging.getLogger("jetserve.agent"))
    http = None
    if args.metrics_port is not None:
        http = executor.probe(args.metrics_host, args.metrics_port)
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


def _register_demo_tools(registry: Registry, client: RedisClient, crash: CrashPoints) -> None:
    """The demo tools, their bank in Redis, each able to crash at a step point."""
    from tools import ToolContext
    from workers.agent.demo_tools import DemoBank, demo_tools

    def hook(point: str, ctx: ToolContext) -> None:
        crash.maybe(point, ctx.run_id, ctx.step, ctx.call_id)

    for tool in demo_tools(DemoBank(client, hook=hook)):
        registry.register(tool)


def load_tools(spec: str) -> list[Tool]:
    """``pkg.module:factory`` -> the tools ``factory()`` returns (an iterable of
    ``tools.Tool``: in-process functions or ``Remote`` NATS services)."""
    import importlib

    module, _, name = spec.partition(":")
    if not module or not name:
        raise SystemExit(f"--tools-module {spec!r}: expected pkg.module:factory")
    factory = getattr(importlib.import_module(module), name)
    return list(factory())

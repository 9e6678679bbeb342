"""``jetserve up``: the embedded default fleet on loopback, for people."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import httpx

from jetserve.commands import up_demo
from jetserve.commands.admin_client import AdminError
from jetserve.fleet import Fleet, FleetSpec
from jetserve.services import NATS_SYNC_DEFAULT, check_nats_sync

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    u = sub.add_parser("up", allow_abbrev=False, help="run the whole fleet on loopback")
    u.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    u.add_argument("--api-key", default=None, help="demo key (default: a fresh random one)")
    u.add_argument("--workers", type=int, default=2)
    u.add_argument("--profile", default="h100-8b", help="simulator latency profile")
    u.add_argument(
        "--engine",
        default=None,
        metavar="URL",
        help="a running OpenAI-compatible engine (e.g. vLLM) in place of the simulator",
    )
    u.add_argument("--model", default="sim-8b", help="the model name the engine serves")
    u.add_argument("--check", action="store_true", help="run the self-check, then stop")
    u.add_argument(
        "--nats-sync",
        type=nats_sync,
        default=NATS_SYNC_DEFAULT,
        metavar="always|DURATION",
        help="JetStream fsync policy, for every file-backed stream of the server: "
        "'always' (default) fsyncs before each ack; a duration such as 2m (nats-server's "
        "own default) fsyncs that often. docs/reliability.md#durability-settings",
    )
    u.add_argument(
        "--insecure",
        action="store_true",
        help="an open bus: NATS and Redis without credentials (development only)",
    )
    u.set_defaults(func=run_up)


def nats_sync(value: str) -> str:
    try:
        return check_nats_sync(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def self_check(fleet: Fleet) -> str:
    """One real request through gateway -> NATS -> worker -> simulator."""
    response = httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {fleet.api_key}"},
        json={
            "model": fleet.spec.model,
            "messages": [{"role": "user", "content": "Say hello to jetserve."}],
            "max_tokens": 24,
        },
        timeout=30.0,
    )
    response.raise_for_status()
    body = response.json()
    text: str = body["choices"][0]["message"]["content"]
    u = body["usage"]
    return f"{text!r}  (usage: {u['prompt_tokens']} prompt + {u['completion_tokens']} completion)"


def run_up(args: argparse.Namespace) -> int:
    spec = FleetSpec(
        workers=args.workers,
        gateway_port=args.port,
        profile=args.profile,
        api_key=args.api_key,
        insecure=args.insecure,
        nats_sync=args.nats_sync,
        engine_url=args.engine,
        model=args.model,
        agents=1,  # an agent run executor with the demo tools
    )
    engine = f"the engine at {args.engine}" if args.engine else "simulator"
    print(
        f"jetserve up: starting nats-server, redis-server, {engine}, gateway, "
        f"{spec.workers} workers and an agent executor on 127.0.0.1 ...",
        flush=True,
    )
    started = time.monotonic()
    try:
        fleet = Fleet(spec).start()
    except AdminError as exc:  # e.g. an --api-key the gateway refuses (under 32 characters)
        print(f"jetserve up: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    failed = False  # a process died: its logs stay for a look
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(f"ready in {time.monotonic() - started:.1f}s (logs: {fleet.workdir})\n")
        print(f"  base URL : {fleet.base_url}/v1")
        print(f"  API key  : {fleet.api_key}")
        served = f"served by {args.engine}" if args.engine else f"simulated, profile {spec.profile}"
        print(f"  model    : {spec.model} ({served})")
        print(f"  NATS     : {fleet.nats_url}    Redis: {fleet.redis_url_of('admin')}")
        print(
            f"  fsync    : JetStream sync_interval {spec.nats_sync}, "
            f"Redis appendfsync {spec.redis_appendfsync}"
        )
        if fleet.creds is not None:
            print(f"  bus auth : one credential per role in {fleet.creds.root} (docs/security.md)")
        else:
            print("  bus auth : OFF (--insecure): anyone on this machine can read the bus")
        print(f"  metrics  : {fleet.gateway_metrics_urls[0]}   (its own port, loopback)")
        print(f"  admin API: {fleet.admin_url}   (token: {fleet.admin_token})\n")
        print("try:\n")
        print(
            f"  curl -sN {fleet.base_url}/v1/chat/completions \\\n"
            f"    -H 'Authorization: Bearer {fleet.api_key}' \\\n"
            "    -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{spec.model}", "stream": true, '
            f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n'
        )
        print(
            "admin CLI:\n\n"
            f"  export JETSERVE_ADMIN_URL={fleet.admin_url}\n"
            f"  export JETSERVE_ADMIN_TOKEN_FILE={fleet.secret_env['JETSERVE_ADMIN_TOKEN_FILE']}\n"
            "  jetserve tenants create acme\n"
            "  jetserve keys create --tenant acme\n"
            "  jetserve limits set --level tenant --id acme --budget-usd 5 --rpm 600\n"
            f"  jetserve ledger --tenant {spec.tenant}\n"
        )
        approver = up_demo.prepare(fleet)
        print(up_demo.examples(fleet, approver))
        print(f"self-check: {self_check(fleet)}", flush=True)
        print(f"agent run : {up_demo.agent_check(fleet, approver)}\n", flush=True)
        if args.check:
            return 0
        print("serving; Ctrl-C stops everything.", flush=True)
        while not stop.wait(0.5):
            dead = [
                p.name
                for p in (fleet.gateway, fleet.sim, *fleet.workers, *fleet.agents)
                if p is not None and p.proc.poll() is not None
            ]
            if dead:
                print(f"stopping: {', '.join(dead)} exited (logs kept: {fleet.workdir})")
                failed = True
                return 1
        return 0
    finally:
        print("stopping ...", flush=True)
        fleet.stop(keep=failed)
        print("stopped.")

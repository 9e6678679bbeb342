"""The ``jetserve`` console script: the composition root, the one place that
imports every package."""

# Each command group registers itself from its module in jetserve/commands/.

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jetserve.commands import (
    accounting,
    agent,
    bench,
    conformance,
    credentials,
    gateway,
    keys,
    ledger,
    limits,
    routes,
    scale,
    sim,
    tenants,
    up,
    worker,
)
from streams.errors import CredentialError, SecretError
from streams.logs import configure

# In `jetserve --help` order.
GROUPS = (
    gateway, worker, agent, sim, tenants, keys, limits, ledger, routes, scale, up, bench,
    conformance, credentials, accounting,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetserve", description=__doc__, allow_abbrev=False)
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--log-format",
        choices=["json", "text"],
        default="json",
        help="JSON lines (one event per line: request id, tenant, class, worker) or text",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `sim` owns its own flags: hand everything after it to the simulator's parser.
    head = argv
    while head and head[0].split("=", 1)[0] in ("--log-level", "--log-format"):
        head = head[1:] if "=" in head[0] else head[2:]
    if head[:1] == ["sim"]:
        return sim.run(head[1:])
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format)
    try:
        result: int = args.func(args)
    except (CredentialError, SecretError) as exc:
        # Fail closed, and say why in one line (no traceback to dig through).
        print(f"jetserve {args.cmd}: {exc.message}", file=sys.stderr)
        return 2
    return result

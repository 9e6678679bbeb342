"""The ``jetserve`` console script: the composition root, the one place that
imports every package."""

# Each command group registers itself from its module in jetserve/commands/. A run of
# one command imports only that command's module: every fleet process (gateway,
# worker, simulator, executor) starts without the others' imports (the simulator
# half as long); help and unknown commands load them all.

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from streams.errors import CredentialError, SecretError
from streams.logs import configure

# Module name (in jetserve/commands/) -> the commands it registers, in
# `jetserve --help` order.
GROUPS: dict[str, tuple[str, ...]] = {
    "gateway": ("gateway",),
    "worker": ("worker",),
    "agent": ("agent",),
    "sim": ("sim",),
    "tenants": ("tenants",),
    "keys": ("keys",),
    "limits": ("limits",),
    "ledger": ("ledger",),
    "routes": ("routes",),
    "scale": ("scale",),
    "up": ("up",),
    "bench": ("bench",),
    "conformance": ("conformance",),
    "credentials": ("credentials", "nats-config"),
    "accounting": ("accounting",),
}
GLOBAL_FLAGS = ("--log-level", "--log-format")


def _group(module: str) -> ModuleType:
    return importlib.import_module(f"jetserve.commands.{module}")


def _groups_for(command: str | None) -> list[ModuleType]:
    """The one module that registers ``command``; every module when it names none."""
    named = [m for m, commands in GROUPS.items() if command in commands]
    return [_group(m) for m in (named or GROUPS)]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetserve", description=__doc__, allow_abbrev=False)
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--log-format",
        choices=["json", "text"],
        default="json",
        help="JSON lines (one event per line: request id, tenant, class, worker) or text",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for group in _groups_for(command):
        group.register(sub)
    return p


def _command(argv: Sequence[str]) -> list[str]:
    """``argv`` from its command on: the global flags before it skipped."""
    head = list(argv)
    while head and head[0].split("=", 1)[0] in GLOBAL_FLAGS:
        head = head[1:] if "=" in head[0] else head[2:]
    return head


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    head = _command(argv)
    if head[:1] == ["sim"]:
        # `sim` owns its own flags: everything after it goes to the simulator's parser.
        return _group("sim").run(head[1:])  # type: ignore[no-any-return]
    args = build_parser(head[0] if head else None).parse_args(argv)
    configure(args.log_level, args.log_format)
    try:
        result: int = args.func(args)
    except (CredentialError, SecretError) as exc:
        # Fail closed, and say why in one line (no traceback to dig through).
        print(f"jetserve {args.cmd}: {exc.message}", file=sys.stderr)
        return 2
    return result

"""What the admin-API commands (tenants, keys, limits, ledger, routes) share: the
``--admin-url``/``--admin-token`` options, the client, and the one error report."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from jetserve.commands.admin_client import AdminClient, AdminError
from jetserve.commands.common import DEFAULT_ADMIN

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers

# One admin action: it talks to the API and prints; errors are AdminError.
Action = Callable[[AdminClient, argparse.Namespace], None]


def add_admin_options(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--admin-url", default=DEFAULT_ADMIN)
    ap.add_argument("--admin-token", default=None, help="default: $JETSERVE_ADMIN_TOKEN")
    return ap


def admin_group(sub: Subparsers, name: str, help_text: str) -> Subparsers:
    """``jetserve NAME ACTION ...``: the group's actions (``admin_action``)."""
    ap = sub.add_parser(name, allow_abbrev=False, help=help_text)
    return ap.add_subparsers(dest="action", required=True)


def admin_command(
    sub: Subparsers, name: str, action: Action, help_text: str | None = None
) -> argparse.ArgumentParser:
    """A command (or a group's action) that runs ``action`` against the admin API."""
    # No help= at all, not help=None: argparse lists the two differently.
    if help_text is None:
        ap = sub.add_parser(name, allow_abbrev=False)
    else:
        ap = sub.add_parser(name, allow_abbrev=False, help=help_text)
    add_admin_options(ap)
    ap.set_defaults(func=functools.partial(run_admin, action))
    return ap


def run_admin(action: Action, args: argparse.Namespace) -> int:
    try:
        with client(args) as admin:
            action(admin, args)
    except AdminError as exc:
        print(f"jetserve {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


def client(args: argparse.Namespace) -> AdminClient:
    token = args.admin_token or os.environ.get("JETSERVE_ADMIN_TOKEN")
    if not token:
        raise SystemExit("the admin API needs a token: --admin-token or JETSERVE_ADMIN_TOKEN")
    return AdminClient(args.admin_url, token)


def show(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))

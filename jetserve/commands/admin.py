"""What the admin-API commands (tenants, keys, limits, ledger, routes) share: the
``--admin-url`` option, the admin token (``JETSERVE_ADMIN_TOKEN_FILE`` or
``JETSERVE_ADMIN_TOKEN``, never a flag: ``ps`` shows every process's arguments),
the client, and the one error report."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from jetserve.commands.admin_client import AdminClient, AdminError
from jetserve.commands.common import DEFAULT_ADMIN
from streams.errors import CredentialError
from streams.secrets import read_secret

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers

ADMIN_TOKEN_ENV = "JETSERVE_ADMIN_TOKEN"
# One admin action: it talks to the API and prints; errors are AdminError.
Action = Callable[[AdminClient, argparse.Namespace], None]


def add_admin_options(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--admin-url", default=DEFAULT_ADMIN)
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
    # Both errors end the command with their one line (jetserve.cli.main).
    token = read_secret(ADMIN_TOKEN_ENV)
    if not token:
        raise CredentialError(
            f"the admin API needs a token: set {ADMIN_TOKEN_ENV}_FILE (or {ADMIN_TOKEN_ENV})"
        )
    return AdminClient(args.admin_url, token)


def show(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))

"""``jetserve keys create|list|rotate|revoke``: API keys through the admin API."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from jetserve.commands.admin import admin_command, admin_group, show
from jetserve.commands.admin_client import AdminClient, AdminError
from jetserve.commands.common import split_csv

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers

SCOPES = ("models", "classes", "tools", "data_classes")
# Mirrors gateway.tenancy.keys (the CLI does not import the gateway); the
# server is the one that enforces them.
ACTIONS = ("inference", "approve")
MIN_KEY_CHARS = 32


def register(sub: Subparsers) -> None:
    actions = admin_group(sub, "keys", "API keys (admin API)")
    kc = admin_command(actions, "create", _create)
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--name", default="")
    kc.add_argument("--models", default=None, help="comma-separated; default any")
    kc.add_argument("--classes", default=None, help="comma-separated; default any")
    kc.add_argument("--tools", default=None)
    kc.add_argument("--data-classes", dest="data_classes", default=None)
    kc.add_argument(
        "--scope",
        dest="actions",
        action="append",
        choices=ACTIONS,
        default=None,
        help="what the key may do (repeatable; default: inference). 'approve': decide the "
        "gated tool calls of the tenant's runs (never those of runs this key created)",
    )
    kc.add_argument(
        "--key", default=None, help=f"use this plaintext (at least {MIN_KEY_CHARS} characters)"
    )
    kc.add_argument("--create-tenant", action="store_true", help="create the tenant if missing")
    admin_command(actions, "list", _list).add_argument("--tenant", required=True)
    admin_command(actions, "rotate", _rotate).add_argument("key_id")
    admin_command(actions, "revoke", _revoke).add_argument("key_id")


def scopes(args: argparse.Namespace) -> dict[str, list[str]]:
    out = {name: list(split_csv(value)) for name in SCOPES if (value := getattr(args, name, None))}
    if getattr(args, "actions", None):
        out["actions"] = list(dict.fromkeys(args.actions))
    return out


def _create(admin: AdminClient, args: argparse.Namespace) -> None:
    if args.create_tenant:
        try:
            admin.create_tenant(args.tenant)
        except AdminError as exc:
            if exc.status != 409:  # it exists already: fine
                raise
    created = admin.create_key(args.tenant, args.name, scopes(args), args.key)
    show(created["key"])
    print(f"api_key: {created['api_key']}   (shown once; only its hash is stored)")


def _list(admin: AdminClient, args: argparse.Namespace) -> None:
    show(admin.list_keys(args.tenant))


def _rotate(admin: AdminClient, args: argparse.Namespace) -> None:
    created = admin.rotate_key(args.key_id)
    show(created["key"])
    print(f"api_key: {created['api_key']}   (shown once; the old key is revoked)")


def _revoke(admin: AdminClient, args: argparse.Namespace) -> None:
    show(admin.revoke_key(args.key_id))

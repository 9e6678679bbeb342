"""``jetserve tenants create|list|show``: tenants through the admin API."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from jetserve.commands.admin import admin_command, admin_group, show
from jetserve.commands.admin_client import AdminClient

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    actions = admin_group(sub, "tenants", "tenants (admin API)")
    create = admin_command(actions, "create", _create)
    create.add_argument("tenant")
    create.add_argument("--org", default=None, help="default: an org named like the tenant")
    create.add_argument("--name", default="")
    admin_command(actions, "list", _list)
    admin_command(actions, "show", _show).add_argument("tenant")


def _create(admin: AdminClient, args: argparse.Namespace) -> None:
    show(admin.create_tenant(args.tenant, args.org or "", args.name))


def _list(admin: AdminClient, args: argparse.Namespace) -> None:
    show(admin.list_tenants())


def _show(admin: AdminClient, args: argparse.Namespace) -> None:
    show(admin.show_tenant(args.tenant))

"""``jetserve limits set|show``: budgets and rate limits through the admin API."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from jetserve.commands.admin import admin_command, admin_group, show
from jetserve.commands.admin_client import AdminClient

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers

LEVELS = ["org", "tenant", "key"]


def register(sub: Subparsers) -> None:
    actions = admin_group(sub, "limits", "budgets and rate limits (admin API)")
    ls = admin_command(actions, "set", _set)
    ls.add_argument("--level", choices=LEVELS, required=True)
    ls.add_argument("--id", required=True)
    ls.add_argument("--budget-usd", type=float, default=None)
    ls.add_argument("--period", choices=["day", "month", "total"], default=None)
    ls.add_argument("--rpm", type=int, default=None)
    ls.add_argument("--tpm", type=int, default=None)
    ls.add_argument(
        "--weight",
        type=float,
        default=None,
        help="a tenant's share of a busy class against other tenants' (default 1)",
    )
    lsh = admin_command(actions, "show", _show)
    lsh.add_argument("--level", choices=LEVELS, required=True)
    lsh.add_argument("--id", required=True)


def _set(admin: AdminClient, args: argparse.Namespace) -> None:
    # Only the flags given change; the others keep their current value.
    current = admin.get_limits(args.level, args.id)
    names = ("budget_micros", "period", "rpm", "tpm", "weight")
    limits = {k: current.get(k) for k in names}
    if args.budget_usd is not None:
        limits["budget_micros"] = round(args.budget_usd * 1_000_000)
    for name in ("period", "rpm", "tpm", "weight"):
        if getattr(args, name) is not None:
            limits[name] = getattr(args, name)
    show(admin.set_limits(args.level, args.id, **limits))


def _show(admin: AdminClient, args: argparse.Namespace) -> None:
    show(admin.get_limits(args.level, args.id))

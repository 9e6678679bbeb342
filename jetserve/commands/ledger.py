"""``jetserve ledger``: query or export a tenant's request ledger (admin API)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from jetserve.commands.admin import admin_command
from jetserve.commands.admin_client import AdminClient

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    led = admin_command(sub, "ledger", _export, "query/export the ledger")
    led.add_argument("--tenant", required=True)
    led.add_argument("--since", type=float, default=None, help="unix seconds")
    led.add_argument("--until", type=float, default=None, help="unix seconds")
    led.add_argument("--out", default=None, help="write JSONL here (default: stdout)")


def _export(admin: AdminClient, args: argparse.Namespace) -> None:
    text = admin.ledger(args.tenant, args.since, args.until)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
        print(f"wrote {text.count(chr(10))} records to {args.out}")
    else:
        sys.stdout.write(text)

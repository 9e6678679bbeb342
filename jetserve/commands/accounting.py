"""``jetserve accounting tag-keys``: move accounting keys written before the
``{org}`` hash tags to their tagged names (gateway/tenancy/accounting_migrate.py)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from jetserve.commands.common import DEFAULT_REDIS, add_bus_args, redis_password

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    group = sub.add_parser("accounting", allow_abbrev=False, help="accounting keys in Redis")
    actions = group.add_subparsers(dest="action", required=True)
    tag = actions.add_parser(
        "tag-keys",
        allow_abbrev=False,
        help="move limits, spend and holds to their {org}-tagged names (gateways stopped)",
    )
    tag.add_argument("--redis", default=DEFAULT_REDIS, help="the single Redis, as its admin")
    add_bus_args(tag)
    tag.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import redis.asyncio as redis

    from gateway.tenancy.accounting_migrate import tag_untagged_keys

    client = redis.Redis.from_url(args.redis, password=redis_password(args, "admin"))
    try:
        moved = await tag_untagged_keys(client)
    finally:
        await client.aclose()
    print(
        f"renamed {moved.renamed}, merged {moved.merged}, holds {moved.holds}, "
        f"not placed {len(moved.orphaned)}"
    )
    for key in moved.orphaned:
        print(f"  no tenant or key record for {key}: left as it is")
    return 0

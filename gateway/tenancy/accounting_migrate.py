"""Moving accounting keys written before the ``{org}`` hash tags to their tagged
names (gateway/tenancy/accounting_keys.py), on one Redis.

Before the tags a tenant's limits were ``jetserve:acct:limits:tenant:<id>``; a
gateway of this version reads ``jetserve:acct:{<org>}:limits:tenant:<id>`` and would
find nothing: no limits (unlimited), counters from zero, live holds never swept.
:func:`tag_untagged_keys` renames what it finds, with the gateways stopped:

- limits, spend counters and GCRA state: renamed under their org (a tenant's from
  its tenant record, a key's from its key record). Where the tagged key exists
  already (a gateway of this version ran first), spend is added into it and the
  tagged limits and GCRA state are kept (they are the newer);
- live holds: renamed, their counter names rewritten, entered in their org's expiry
  index and the registry of orgs with holds; the old fleet-wide index is dropped;
- settled markers (``done:``) are left: they have no org and expire within
  ``settled_ttl_s`` (30 min); a retry of a request settled before the move may
  then hold again, and is swept.

Renaming keeps each key's TTL. Idempotent: a second run finds nothing to move.

A gateway fails closed until it has run (:func:`check_tagged`): untagged limits
read as none, that is unlimited. The first gateway on a store with no untagged
keys, or this migration, marks the store as tagged (``LAYOUT_KEY``).
A Redis Cluster is migrated by running this on the single Redis first, then
importing into the cluster (``redis-cli --cluster import``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import redis.asyncio as redis

from gateway.tenancy.accounting_keys import DEFAULT_PREFIX, AccountingKeys
from gateway.tenancy.accounting_lua import as_str
from gateway.tenancy.limits import KINDS, LEVELS, SHADOW_TENANT, Level, LimitKind
from streams.errors import ProvisioningError
from streams.redis_client import RedisClient

TENANCY = "jetserve:"  # gateway/tenancy/keys.py's prefix
LAYOUT = "tagged"  # the value of the layout key once every accounting key has its {org}
_UNTAGGED = ("limits", "spend", "gcra", "resv")  # the kinds a pre-tag gateway wrote


def layout_key(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}layout"


async def check_tagged(client: RedisClient, prefix: str = DEFAULT_PREFIX) -> None:
    """Refuse to serve on accounting data written before the ``{org}`` tags: this
    version would read its limits as none (unlimited) and its counters from zero.
    A store without any is marked tagged (the scan runs once per store)."""
    if as_str(await client.get(layout_key(prefix)) or b"") == LAYOUT:
        return
    for kind in _UNTAGGED:
        key = await _first_key(client, f"{prefix}{kind}:*")
        if key is not None:
            raise ProvisioningError(
                f"accounting keys written before the {{org}} hash tags (e.g. {key}): "
                "stop every gateway and run `jetserve accounting tag-keys` "
                "(docs/operations.md#redis-cluster); serving now would read no limits"
            )
    await client.set(layout_key(prefix), LAYOUT)


async def _first_key(client: RedisClient, pattern: str) -> str | None:
    # The scan is closed here, not left suspended for the collector to finalise.
    scan = cast(AsyncGenerator[Any, None], client.scan_iter(match=pattern, count=1000))
    async with contextlib.aclosing(scan) as keys:
        async for key in keys:
            return as_str(key)
    return None


@dataclass
class Moved:
    """What a run moved, and what it could not place (no such tenant or key)."""

    renamed: int = 0
    merged: int = 0
    holds: int = 0
    orphaned: list[str] = field(default_factory=list)


class _Orgs:
    """The org of a tenant or key, from the tenancy records (cached)."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._cache: dict[tuple[str, str], str | None] = {}

    async def of(self, level: str, ident: str) -> str | None:
        if level == "org" or ident == SHADOW_TENANT:
            return ident
        if (level, ident) not in self._cache:
            self._cache[level, ident] = await self._lookup(level, ident)
        return self._cache[level, ident]

    async def _lookup(self, level: str, ident: str) -> str | None:
        if level == "tenant":
            raw = await self._redis.get(f"{TENANCY}tenant:{ident}")
            return None if raw is None else str(msgspec.json.decode(raw)["org"])
        digest = await self._redis.get(f"{TENANCY}keyid:{ident}")
        raw = await self._redis.get(f"{TENANCY}apikey:{as_str(digest)}") if digest else None
        if raw is None:
            return None
        record: dict[str, Any] = msgspec.json.decode(raw)
        return str(record.get("org") or record["tenant"])  # Scope.of's rule


async def tag_untagged_keys(client: redis.Redis, prefix: str = DEFAULT_PREFIX) -> Moved:
    """Move every untagged accounting key under ``prefix`` (see the module)."""
    keys, orgs, moved = AccountingKeys(prefix), _Orgs(client), Moved()
    renames: dict[str, str] = {}  # old counter name -> new, for the holds' c1..c3
    for kind in ("limits", "spend", "gcra"):
        async for old in _scan(client, f"{prefix}{kind}:*"):
            new = await _tagged(keys, orgs, old[len(prefix) :])
            if new is None:
                moved.orphaned.append(old)
                continue
            renames[old] = new
            await _move(client, old, new, merge=kind == "spend", moved=moved)
    now_us = int(time.time() * 1_000_000)
    async for old in _scan(client, f"{prefix}resv:*"):
        hold = {as_str(k): as_str(v) for k, v in (await client.hgetall(old)).items()}
        org, request_id = hold.get("org"), old[len(f"{prefix}resv:") :]
        if not org:
            moved.orphaned.append(old)
            continue
        fields = {c: renames.get(hold[c], hold[c]) for c in ("c1", "c2", "c3") if c in hold}
        new = keys.resv(org, request_id)
        if fields:
            await client.hset(old, mapping=fields)  # type: ignore[arg-type]
        await client.rename(old, new)
        await client.zadd(keys.index(org), {request_id: int(hold.get("expires", now_us))})
        await client.zadd(keys.registry, {org: now_us}, gt=True)
        moved.holds += 1
    await client.delete(f"{prefix}resv-expiry")
    await client.set(layout_key(prefix), LAYOUT)  # what it could not place is reported
    return moved


async def _scan(client: redis.Redis, pattern: str) -> AsyncIterator[str]:
    # Collected first: renaming while SCAN walks may show a key twice.
    found = [as_str(k) async for k in client.scan_iter(match=pattern, count=1000)]
    for key in found:
        yield key


async def _tagged(keys: AccountingKeys, orgs: _Orgs, rest: str) -> str | None:
    """The tagged name of an untagged ``limits:``/``spend:``/``gcra:`` key (``rest``
    is it without the prefix); None when its tenant or key is unknown."""
    parts = rest.split(":")
    kind = parts[0]
    if kind == "limits" and len(parts) == 3 and parts[1] in LEVELS:
        level: Level = parts[1]
        org = await orgs.of(level, parts[2])
        return None if org is None else keys.limits(org, level, parts[2])
    if kind == "spend" and len(parts) == 4 and parts[1] in LEVELS:
        level = parts[1]
        org = await orgs.of(level, parts[3])
        return None if org is None else keys.spend(org, level, parts[2], parts[3])
    if kind == "gcra" and len(parts) == 4 and parts[1] in KINDS and parts[2] in LEVELS:
        rate: LimitKind = parts[1]
        level = parts[2]
        org = await orgs.of(level, parts[3])
        return None if org is None else keys.gcra(org, rate, level, parts[3])
    return None


async def _move(client: redis.Redis, old: str, new: str, *, merge: bool, moved: Moved) -> None:
    if await client.renamenx(old, new):
        moved.renamed += 1
        return
    if merge:  # a gateway of this version counted into the tagged one already
        counters = await client.hgetall(old)
        for name, value in counters.items():
            await client.hincrby(new, as_str(name), int(value))
    await client.delete(old)
    moved.merged += 1

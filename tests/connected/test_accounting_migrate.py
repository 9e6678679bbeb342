"""Accounting keys written before the ``{org}`` tags, moved to their tagged names
on a real redis-server (gateway/tenancy/accounting_migrate.py)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.errors import BudgetExceeded
from gateway.tenancy.accounting import Accountant, LimitSpec, Scope
from gateway.tenancy.accounting_migrate import check_tagged, layout_key, tag_untagged_keys
from gateway.tenancy.keys import Tenancy
from jetserve.services import Service
from streams.errors import ProvisioningError

pytestmark = pytest.mark.connected

P = "jetserve:acct:"
T0 = 1_700_000_000.0


async def test_untagged_limits_counters_and_holds_are_moved(redis_server: Service) -> None:
    client = aioredis.from_url(redis_server.redis_url("admin"))
    try:
        tenancy = Tenancy(client, key_secret=b"s" * 32)
        await tenancy.create_tenant("t1", "o1")
        _, key = await tenancy.create_key("t1")
        kid = key.key_id
        # As a gateway before the tags left them: limits, counters, one live hold.
        await client.hset(f"{P}limits:tenant:t1", mapping={"budget": 5000, "period": "total"})
        await client.hset(f"{P}limits:key:{kid}", mapping={"period": "month", "rpm": 60})
        await client.hset(f"{P}limits:org:o1", mapping={"period": "total"})
        await client.hset(f"{P}limits:tenant:gone", mapping={"budget": 1})  # no such tenant
        counters = [f"{P}spend:org:total:o1", f"{P}spend:tenant:total:t1"]
        counters.append(f"{P}spend:key:202311:{kid}")
        for name in counters:
            await client.hset(name, mapping={"spent": 1000, "reserved": 700})
        await client.set(f"{P}gcra:rpm:key:{kid}", "1.7e15")
        hold: dict[str, str | int] = {
            "cost": 700,
            "tokens": 1,
            "created": int(T0 * 1e6),
            "expires": int(T0 * 1e6) + 10,
        }
        hold |= {"org": "o1", "tenant": "t1", "key": kid}
        hold |= {"c1": counters[0], "c2": counters[1], "c3": counters[2]}
        await client.hset(f"{P}resv:r1", mapping=hold)  # type: ignore[arg-type]
        await client.zadd(f"{P}resv-expiry", {"r1": hold["expires"]})
        # A gateway of this version counted into a tagged counter before the move.
        acct = Accountant(client, clock=lambda: T0 + 60)
        await client.hset(acct.keys.spend("o1", "org", "total", "o1"), "spent", 5)

        moved = await tag_untagged_keys(client)
        assert (moved.renamed, moved.merged, moved.holds) == (6, 1, 1)
        assert moved.orphaned == [f"{P}limits:tenant:gone"]
        assert await tag_untagged_keys(client) == type(moved)(orphaned=moved.orphaned)

        assert await acct.get_limits("tenant", "t1", org="o1") == LimitSpec(5000, "total")
        assert (await acct.get_limits("key", kid, org="o1")).rpm == 60
        assert await acct.spend("tenant", "t1", org="o1") == (1000, 700)
        assert await acct.spend("org", "o1") == (1005, 700)
        # The moved hold is in its org's index: the sweep finds it and releases it.
        assert await acct.sweep_expired() == 1
        assert await acct.spend("tenant", "t1", org="o1") == (1000, 0)
        assert not await client.exists(f"{P}resv-expiry")
        # And the moved budget binds: 4000 left of 5000.
        with pytest.raises(BudgetExceeded):
            await acct.reserve(Scope("o1", "t1", kid), "r2", 4001, 1)
    finally:
        await client.aclose()


async def test_a_gateway_refuses_untagged_accounting_until_they_are_moved(
    redis_server: Service,
) -> None:
    """Fail closed: on untagged limits a gateway of this version would read none
    (unlimited); it refuses to start until `jetserve accounting tag-keys` ran."""
    client = aioredis.from_url(redis_server.redis_url("admin"))
    try:
        await check_tagged(client)  # a fresh store: marked tagged at once
        assert await client.get(layout_key()) == b"tagged"
        await client.delete(layout_key())
        tenancy = Tenancy(client, key_secret=b"s" * 32)
        await tenancy.create_tenant("t9", "o9")
        await client.hset(f"{P}limits:tenant:t9", mapping={"budget": 5, "period": "total"})
        with pytest.raises(ProvisioningError, match="jetserve accounting tag-keys"):
            await check_tagged(client)
        assert await client.get(layout_key()) is None
        await tag_untagged_keys(client)
        await check_tagged(client)  # moved: the gateway may start
        acct = Accountant(client)
        assert await acct.get_limits("tenant", "t9", org="o9") == LimitSpec(5, "total")
    finally:
        await client.aclose()

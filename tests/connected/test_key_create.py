"""Creating a key an operator chose (gateway/tenancy/keys.py), on a real Redis."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.errors import BadRequest
from gateway.tenancy.keys import Tenancy
from jetserve.services import Service

pytestmark = pytest.mark.connected

P = "jetserve:"
CHOSEN = "sk-operator-chosen-0123456789abcdef"


async def test_a_create_cut_half_way_is_finished_by_its_retry(redis_server: Service) -> None:
    """The record is written first, then its id's pointer and the tenant's list (three
    slots on a cluster). A create cut between them left a live key nobody could list
    or revoke, and with create-only records its retry got 409 for ever."""
    client = aioredis.from_url(redis_server.redis_url("admin"))
    try:
        tenancy = Tenancy(client, ttl=0.0, key_secret=b"s" * 32)
        await tenancy.create_tenant("t1", "o1")
        await tenancy.create_tenant("t2", "o2")
        _, first = await tenancy.create_key("t1", plaintext=CHOSEN)
        # As if the create had stopped after the record: no pointer, not listed.
        await client.delete(f"{P}keyid:{first.key_id}")
        await client.srem(f"{P}tenantkeys:t1", first.key_id)
        with pytest.raises(BadRequest) as other:
            await tenancy.create_key("t2", plaintext=CHOSEN)  # never another tenant's
        assert other.value.status == 409
        _, again = await tenancy.create_key("t1", plaintext=CHOSEN)  # the retry
        assert again.key_id == first.key_id
        assert [k.key_id for k in await tenancy.list_keys("t1")] == [first.key_id]
        assert (await tenancy.revoke_key(first.key_id)).revoked
        with pytest.raises(BadRequest) as whole:
            await tenancy.create_key("t1", plaintext=CHOSEN)  # a finished key: taken
        assert whole.value.status == 409
    finally:
        await client.aclose()

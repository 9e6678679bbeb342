"""The registry behind coalescing across replicas, in a real Redis (its Lua
scripts: gateway/inference/coalesce_fleet.py): who leads, who follows, who stops
the engine and who pays, whatever order the replicas come and go in."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.inference.coalesce_fleet import FleetCoalescing, hash_key
from jetserve.services import Service

pytestmark = pytest.mark.connected


@pytest.fixture
async def replicas(redis_server: Service) -> AsyncIterator[list[FleetCoalescing]]:
    clients = [aioredis.from_url(redis_server.redis_url("gateway")) for _ in range(3)]
    yield [FleetCoalescing(c) for c in clients]
    for c in clients:
        await c.aclose()


def _key() -> str:
    return f"tenant-a/{uuid.uuid4().hex}"


async def test_one_leads_the_others_follow_and_the_leader_pays(
    replicas: list[FleetCoalescing],
) -> None:
    a, b, c = replicas
    key, deadline = _key(), time.time() + 30
    assert (await a.claim(key, "lead-1", "tenant-a", deadline, deadline - 1)).kind == "lead"
    for r in (b, c):
        claim = await r.claim(key, f"own-{id(r)}", "tenant-a", deadline, deadline - 1)
        assert (claim.kind, claim.request_id, claim.tenant) == ("follow", "lead-1", "tenant-a")
    # The leader reads to the end: it pays, the followers do not, and it pays once.
    assert not await b.pay(key, "lead-1", leads=False)
    assert await a.pay(key, "lead-1", leads=True)
    assert not await a.pay(key, "lead-1", leads=True)
    assert not await c.pay(key, "lead-1", leads=False)
    await a.end(key, "lead-1")
    # Ended: the next identical request leads a new execution.
    assert (await b.claim(key, "lead-2", "tenant-a", deadline, deadline - 1)).kind == "lead"


async def test_the_leader_leaving_opens_the_charge_and_the_last_out_stops(
    replicas: list[FleetCoalescing],
) -> None:
    a, b, c = replicas
    key, deadline = _key(), time.time() + 30
    await a.claim(key, "lead-1", "tenant-a", deadline, deadline - 1)
    await b.claim(key, "b-1", "tenant-a", deadline, deadline - 1)
    await c.claim(key, "c-1", "tenant-a", deadline, deadline - 1)
    assert await a.leave(key, "lead-1", leads=True) == 2  # others read on: no stop
    assert not await a.pay(key, "lead-1", leads=True)  # the charge moved to them
    assert await b.leave(key, "lead-1", leads=False) == 1
    assert await c.leave(key, "lead-1", leads=False) == 0  # the last one out stops it
    assert await c.pay(key, "lead-1", leads=False)  # and pays for what ran
    assert not await b.pay(key, "lead-1", leads=False)
    assert await c.leave(key, "lead-1", leads=False) == -1  # gone: nothing to stop twice


async def test_an_execution_ending_too_early_is_not_followed(
    replicas: list[FleetCoalescing],
) -> None:
    a, b, _ = replicas
    key, deadline = _key(), time.time() + 5
    await a.claim(key, "lead-1", "tenant-a", deadline, deadline - 1)
    later = deadline + 60  # this request may wait a minute longer than the leader's
    assert (await b.claim(key, "b-1", "tenant-a", later, later - 1)).kind == "late"
    assert await a.leave(key, "lead-1", leads=True) == 0  # "late" was not counted


async def test_no_redis_means_each_replica_its_own_and_the_leader_pays(
    redis_server: Service,
) -> None:
    client = aioredis.from_url(redis_server.redis_url("gateway"), socket_timeout=1.0)
    registry = FleetCoalescing(client)
    key, deadline = _key(), time.time() + 30
    try:
        assert (await registry.claim(key, "lead-1", "tenant-a", deadline, deadline)).kind == "lead"
        assert await client.exists(hash_key(key))
        redis_server.stop()
        assert (await registry.claim(_key(), "x", "tenant-a", deadline, deadline)).kind == (
            "unshared"
        )
        assert await registry.leave(key, "lead-1", leads=True) is None  # never a stop
        assert await registry.pay(key, "lead-1", leads=True)
        assert not await registry.pay(key, "lead-1", leads=False)
    finally:
        await client.aclose()

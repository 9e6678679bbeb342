"""The gateway's Redis stores on a real Redis Cluster (3 primaries, the
deployment's ACL users): every multi-key script names keys of one hash slot,
orgs spread over the primaries, and the hold sweep finds every org's holds
(gateway/tenancy/accounting_keys.py, streams/redis_client.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from itertools import count

import httpx
import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from gateway.errors import BudgetExceeded, RateLimited
from gateway.inference.coalesce_fleet import FleetCoalescing, hash_key, paid_key
from gateway.inference.hedge_budget import SharedHedgeBudget
from gateway.tenancy.accounting import Accountant, LimitSpec, Scope
from gateway.tenancy.accounting_keys import REGISTRY_MARGIN_S, REGISTRY_REFRESH_S
from gateway.tenancy.idempotency import IdempotencyStore
from gateway.tenancy.keys import Tenancy
from gateway.tenancy.tickets import TicketStore
from jetserve.fleet import Fleet, FleetSpec
from jetserve.services import Service
from streams.redis_client import open_redis
from tests.waits import until
from tools import ToolContext
from workers.agent.demo_tools import DemoBank

pytestmark = pytest.mark.connected

T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def cluster(redis_cluster: list[Service]) -> AsyncIterator[aioredis.RedisCluster]:
    """A cluster client as the gateway opens it: its own ACL user, one seed node."""
    client = open_redis(redis_cluster[1].redis_url("gateway"), cluster=True)
    assert isinstance(client, aioredis.RedisCluster)
    await client.initialize()  # the slot map, for node_of() before any command
    yield client
    await client.aclose()


def node_of(client: aioredis.RedisCluster, key: str) -> str:
    node = client.get_node_from_key(key)
    assert node is not None
    return str(node.name)


def orgs_on_every_primary(client: aioredis.RedisCluster, acct: Accountant) -> list[str]:
    """One org id per primary, each org's keys on its own primary."""
    tag = uuid.uuid4().hex[:6]
    by_node: dict[str, str] = {}
    for n in count():
        org = f"org-{tag}-{n}"
        by_node.setdefault(node_of(client, acct.keys.index(org)), org)
        if len(by_node) == 3:
            return list(by_node.values())
    raise AssertionError("unreachable")


async def test_each_orgs_keys_share_a_slot_and_orgs_spread_over_primaries(
    cluster: aioredis.RedisCluster,
) -> None:
    acct = Accountant(cluster, clock=Clock())
    orgs = orgs_on_every_primary(cluster, acct)
    for org in orgs:
        scope = Scope(org, f"{org}-t", f"{org}-k")
        keys = acct._reserve_keys(scope, "r1", T0)
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
        assert key_slot(acct.keys.resv(org, "r1").encode()) == key_slot(keys[0].encode())
    slots = {key_slot(acct.keys.index(org).encode()) for org in orgs}
    nodes = {node_of(cluster, acct.keys.index(org)) for org in orgs}
    assert len(slots) == 3
    assert len(nodes) == 3


async def test_budgets_limits_and_settling_per_org_on_three_primaries(
    cluster: aioredis.RedisCluster,
) -> None:
    clock = Clock()
    acct = Accountant(cluster, clock=clock)
    orgs = orgs_on_every_primary(cluster, acct)
    for i, org in enumerate(orgs):
        tenant, key = f"{org}-t", f"{org}-k"
        scope = Scope(org, tenant, key)
        budget = 10_000 * (i + 1)
        await acct.set_limits("tenant", tenant, LimitSpec(budget_micros=budget), org=org)
        await acct.set_limits("org", org, LimitSpec(budget_micros=10**9))
        assert (await acct.get_limits("tenant", tenant, org=org)).budget_micros == budget
        # Reserve the whole budget in two holds; a third is refused and changes nothing.
        await acct.reserve(scope, f"{org}-a", budget // 2, 10)
        await acct.reserve(scope, f"{org}-b", budget // 2, 10)
        with pytest.raises(BudgetExceeded):
            await acct.reserve(scope, f"{org}-c", 1, 10)
        assert await acct.spend("tenant", tenant, org=org) == (0, budget)
        assert await acct.spend("org", org) == (0, budget)
        # Reconcile one below its hold, release the other.
        assert await acct.reconcile(f"{org}-a", 1_234, org=org) == 1_234
        assert await acct.settle_as(f"{org}-a", 1_234, org=org) == ("other", 0)
        await acct.release(f"{org}-b", org=org)
        assert await acct.spend("tenant", tenant, org=org) == (1_234, 0)
        assert await acct.spend("key", key, org=org) == (1_234, 0)
    # A settlement names the org it was held in: another org's slot holds nothing.
    assert await acct.settle_as(f"{orgs[0]}-a", 1, "w", org=orgs[1]) == ("none", 0)


async def test_gcra_rate_limits_per_org_on_the_cluster(cluster: aioredis.RedisCluster) -> None:
    clock = Clock()
    acct = Accountant(cluster, clock=clock, burst_s=0.0)
    orgs = orgs_on_every_primary(cluster, acct)
    for org in orgs:
        tenant = f"{org}-t"
        await acct.set_limits("tenant", tenant, LimitSpec(rpm=60), org=org)
        scope = Scope(org, tenant, f"{org}-k")
        await acct.reserve(scope, f"{org}-1", 0, 1)
        with pytest.raises(RateLimited) as refused:
            await acct.reserve(scope, f"{org}-2", 0, 1)
        assert refused.value.retry_after == pytest.approx(1.0)
    clock.now += 1.0  # one emission interval later every org has room again
    for org in orgs:
        await acct.reserve(Scope(org, f"{org}-t", f"{org}-k"), f"{org}-2", 0, 1)


async def test_the_sweep_finds_every_orgs_expired_holds(cluster: aioredis.RedisCluster) -> None:
    clock = Clock()
    acct = Accountant(cluster, clock=clock)
    orgs = orgs_on_every_primary(cluster, acct)
    for org in orgs:
        scope = Scope(org, f"{org}-t", f"{org}-k")
        await acct.reserve(scope, f"{org}-dead", 500, 1, hold_s=10)
        await acct.reserve(scope, f"{org}-alive", 700, 1, hold_s=1000)
    # Another replica (its own process, its own registration cache) sweeps.
    sweeper = Accountant(cluster, clock=clock)
    assert await sweeper.sweep_expired() == 0
    clock.now += 60
    expired = await sweeper.expired()
    assert {(h.org, h.request_id) for h in expired} >= {(o, f"{o}-dead") for o in orgs}
    # (The cluster is the module's: other tests' holds may be swept too.)
    assert await sweeper.sweep_expired() >= 3
    for org in orgs:
        assert await acct.spend("tenant", f"{org}-t", org=org) == (0, 700)
        assert await acct.reconcile(f"{org}-dead", 500, org=org) == 0  # came back too late
        assert await acct.reconcile(f"{org}-alive", 700, org=org) == 700
    # Long after the last registration, orgs with no holds leave the registry;
    # a reserve for one registers it again, and its hold is swept.
    clock.now += REGISTRY_REFRESH_S + REGISTRY_MARGIN_S + 1
    await sweeper.sweep_expired()
    members = await cluster.zrange(acct.keys.registry, 0, -1)
    registered = {m.decode() if isinstance(m, bytes) else str(m) for m in members}
    assert not registered & set(orgs)
    await acct.reserve(Scope(orgs[0], "t", "k"), "late-dead", 100, 1, hold_s=10)
    clock.now += 60
    assert await sweeper.sweep_expired() >= 1
    assert await acct.reconcile("late-dead", 100, org=orgs[0]) == 0  # swept


async def test_a_registered_org_with_holds_is_never_pruned(cluster: aioredis.RedisCluster) -> None:
    clock = Clock()
    acct = Accountant(cluster, clock=clock)
    org = orgs_on_every_primary(cluster, acct)[0]
    await acct.reserve(Scope(org, "t", "k"), "long", 100, 1, hold_s=10 * REGISTRY_MARGIN_S)
    clock.now += REGISTRY_REFRESH_S + REGISTRY_MARGIN_S + 1
    await acct.sweep_expired()  # not expired yet; its org stays listed
    assert await cluster.zscore(acct.keys.registry, org) is not None
    assert await acct.spend("org", org) == (0, 100)
    clock.now += 10 * REGISTRY_MARGIN_S
    assert await acct.sweep_expired() >= 1
    assert await acct.spend("org", org) == (0, 0)


async def test_coalescing_claims_on_the_cluster(cluster: aioredis.RedisCluster) -> None:
    a, b = FleetCoalescing(cluster), FleetCoalescing(cluster)
    keys = [f"tenant-{n}/{uuid.uuid4().hex}" for n in range(6)]
    nodes = {node_of(cluster, hash_key(k)) for k in keys}
    assert len(nodes) > 1  # claims spread by their digest
    deadline = time.time() + 30
    for key in keys:
        assert key_slot(hash_key(key).encode()) == key_slot(paid_key(key, "x").encode())
        assert (await a.claim(key, f"lead-{key}", "t", deadline, deadline - 1)).kind == "lead"
        claim = await b.claim(key, f"own-{key}", "t", deadline, deadline - 1)
        assert (claim.kind, claim.request_id) == ("follow", f"lead-{key}")
        assert await a.leave(key, f"lead-{key}", leads=True) == 1  # the follower reads on
        assert not await a.pay(key, f"lead-{key}", leads=True)  # the charge moved to it
        assert await b.pay(key, f"lead-{key}", leads=False)
        assert await b.leave(key, f"lead-{key}", leads=False) == 0


async def test_idempotency_tickets_and_the_hedge_bank_on_the_cluster(
    cluster: aioredis.RedisCluster,
) -> None:
    idem = IdempotencyStore(cluster, ttl_s=60)
    tenant, body = f"t-{uuid.uuid4().hex[:6]}", b'{"model": "m"}'
    first = await idem.claim(tenant, "key-1", body, time.time() + 5)
    again = await idem.claim(tenant, "key-1", body, time.time() + 5)
    assert (again.request_id, again.attach) == (first.request_id, True)
    await idem.complete(first, body, 200, {"ok": True})
    done = await idem.claim(tenant, "key-1", body, time.time() + 5)
    assert done.replay is not None
    assert done.replay.response == {"ok": True}
    tickets = TicketStore(cluster)
    ticket = await tickets.issue("sk-some-key")
    assert await tickets.redeem(ticket) == "sk-some-key"
    assert await tickets.redeem(ticket) is None
    bank = SharedHedgeBudget(cluster)
    bank.earn("interactive", 1.5)
    assert await bank.take("interactive")
    assert not await bank.take("interactive")


async def test_tenants_and_keys_on_the_cluster(cluster: aioredis.RedisCluster) -> None:
    tenancy = Tenancy(cluster, ttl=0.0, key_secret=b"s" * 32)
    ids = [f"ten-{uuid.uuid4().hex[:6]}-{n}" for n in range(4)]
    for ident in ids:
        await tenancy.create_tenant(ident, f"org-{ident}")
    listed = {t.id for t in await tenancy.list_tenants()}
    assert set(ids) <= listed
    plaintext, record = await tenancy.create_key(ids[0], name="k")
    assert (await tenancy.authenticate(f"Bearer {plaintext}")).key_id == record.key_id
    assert [k.key_id for k in await tenancy.list_keys(ids[0])] == [record.key_id]
    rotated, new = await tenancy.rotate_key(record.key_id)
    assert (await tenancy.get_key(record.key_id)).revoked
    assert (await tenancy.authenticate(f"Bearer {rotated}")).key_id == new.key_id


async def test_the_demo_bank_on_the_cluster(redis_cluster: list[Service]) -> None:
    client = open_redis(redis_cluster[0].redis_url("agent"), cluster=True)
    try:
        bank = DemoBank(client, prefix=f"demobank:{{{uuid.uuid4().hex[:6]}}}:")
        assert len({key_slot(k.encode()) for k in bank.keys}) == 1

        ctx = ToolContext(run_id="run-1", step=1, call_id="call-1")
        await bank.payout({"to": "alice", "amount": 5}, ctx)
        await bank.payout({"to": "alice", "amount": 5}, ctx)  # the same effect: applied once
        assert (await bank.balance({"account": "alice"}, ctx))["balance"] == 5
    finally:
        await client.aclose()


async def test_requests_through_a_fleet_on_a_redis_cluster() -> None:
    """A gateway started with --redis-cluster: keys authenticate, a request is
    charged in its org's slot, and another org's spent budget refuses."""
    spec = FleetSpec(workers=1, profile="fast", redis_nodes=3)
    with Fleet(spec) as fleet, fleet.admin() as admin:
        # A second tenant in an org of its own, with no budget left.
        admin.create_tenant("broke", org="broke-org")
        broke = admin.create_key("broke", "k")["api_key"]
        admin.set_limits("tenant", "broke", budget_micros=0, period="total")

        def chat(key: str) -> httpx.Response:
            body = {
                "model": "sim-8b",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            return httpx.post(
                f"{fleet.base_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            )

        ok = await asyncio.to_thread(chat, fleet.api_key)
        assert ok.status_code == 200, ok.text
        refused = await asyncio.to_thread(chat, broke)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"

        async def charged() -> bool:
            view = await asyncio.to_thread(admin.get_limits, "tenant", fleet.spec.tenant)
            return bool(view["spent_micros"] > 0 and view["reserved_micros"] == 0)

        await until(charged, "the request charged and its hold settled on the cluster")
        client = open_redis(fleet.redis_url, cluster=True)
        try:
            assert isinstance(client, aioredis.RedisCluster)
            acct = Accountant(client)
            await client.initialize()
            tenant = fleet.spec.tenant  # its own org
            spent, reserved = await acct.spend("tenant", tenant, org=tenant)
            assert spent > 0
            assert reserved == 0
            limits = await acct.get_limits("tenant", "broke", org="broke-org")
            assert limits.budget_micros == 0
            assert key_slot(acct.keys.index(tenant).encode()) != key_slot(
                acct.keys.index("broke-org").encode()
            )
        finally:
            await client.aclose()

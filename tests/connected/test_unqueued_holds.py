"""A hold whose gateway died after reserving and before queueing anything: the
orphan sweep finds no frames for it, gives the hold back and writes its ledger
record from the note the hold carries (what it was for), so every accepted
request still ends in one recorded outcome. A hold from an older gateway, with
no note, is only given back."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.tenancy.accounting import Accountant
from gateway.tenancy.limits import Scope
from gateway.tenancy.records import GATEWAY_LOST, RecordHead
from jetserve.fleet import Fleet
from tests.waits import until

pytestmark = pytest.mark.connected


def _records(fleet: Fleet, ids: set[str]) -> list[dict[str, Any]]:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    rows = [msgspec.json.decode(x) for x in text.splitlines() if x]
    return [r for r in rows if r["request_id"] in ids]


@pytest.mark.timeout(120)
async def test_a_hold_never_queued_is_given_back_and_recorded(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0, gateway_args=["--sweep-every", "0.5", "--settle-grace", "0"])
    tenant = fleet.spec.tenant
    scope = Scope(tenant, tenant, fleet.key_id)  # the demo tenant is in no org
    rds = aioredis.Redis.from_url(fleet.redis_url)
    acct = Accountant(rds)
    noted, bare = f"req-{uuid.uuid4().hex}", f"req-{uuid.uuid4().hex}"
    head = RecordHead(
        scope=scope,
        request_id=noted,
        op="embedding",
        cls="embed",
        model=fleet.spec.model,
        created=time.time(),
        price_version="v1",
        gateway="gw-that-died",
    )
    try:
        spent_before, _ = await acct.spend("tenant", tenant, org=tenant)
        # As a gateway reserves, just before it dies: a hold of 0.2 s, noted or not.
        await acct.reserve(scope, noted, 1234, 10, hold_s=0.2, what=head.note())
        await acct.reserve(scope, bare, 4321, 10, hold_s=0.2)
        assert (await acct.spend("tenant", tenant, org=tenant))[1] == 1234 + 4321

        async def given_back() -> bool:
            return (await acct.spend("tenant", tenant, org=tenant))[1] == 0

        await until(given_back, "the sweep to give both holds back", 60.0)

        async def recorded() -> bool:
            return bool(_records(fleet, {noted}))

        await until(recorded, "the noted hold's ledger record", 60.0)
        assert (await acct.spend("tenant", tenant, org=tenant))[0] == spent_before
    finally:
        await rds.aclose()
    rows = _records(fleet, {noted, bare})
    assert [r["request_id"] for r in rows] == [noted]  # the bare hold: given back, no record
    row = rows[0]
    assert row["policy"] == "admitted:released"
    assert row["outcome"] == GATEWAY_LOST
    assert row["status"] == 502
    assert row["charge_micros"] == 0
    assert row["reserved_micros"] == 1234
    assert (row["op"], row["cls"], row["model"]) == ("embedding", "embed", fleet.spec.model)
    assert (row["key_id"], row["gateway"]) == (fleet.key_id, "gw-that-died")
    assert row["attempts"] == 0

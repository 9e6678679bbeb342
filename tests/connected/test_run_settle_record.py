"""An agent run's settlement writes its one ledger record even when the first try
charged and could not record (gateway/runs/settle.py), on real NATS and Redis."""

from __future__ import annotations

import dataclasses
import time

import redis.asyncio as aioredis

from gateway.runs.settle import RunSettler
from gateway.tenancy.accounting import Accountant, Scope
from gateway.tenancy.request_ledger import LedgerReader, LedgerWriter
from jetserve.services import Service
from streams.agent import Budget, Run, Spend
from streams.agent_store import RunStore
from streams.auth import Role
from streams.connect import connect
from streams.request_ledger import DEFAULT_LEDGER, ensure_ledger


async def test_a_run_charged_but_not_recorded_is_recorded_when_settled_again(
    nats_server: Service, redis_server: Service
) -> None:
    """The settler charged the run, then its ledger append failed (the ledger down
    ~9 s) or it was killed before it: the request was acked, or redelivered and
    told "someone else settled it". Charged, no record, ever."""
    url = f"nats://127.0.0.1:{nats_server.port}"
    nc = await connect(url, "gw", nats_server.bus_auth(Role.GATEWAY))
    rds = aioredis.Redis.from_url(redis_server.redis_url("gateway"))
    try:
        js = nc.jetstream()
        await ensure_ledger(js, update=False)
        store = await RunStore.open(nc)
        run = Run(
            id="run_settle_1", tenant="t1", org="t1", key_id="k1", model="sim-8b",
            deadline=time.time() + 60, budget=Budget(max_cost_micros=500), status="completed",
            spent=Spend(steps=2, prompt_tokens=30, completion_tokens=10, cost_micros=77),
        )  # fmt: skip
        await store.create(run)
        acct = Accountant(rds)
        await acct.reserve(Scope("t1", "t1", "k1"), run.id, 500, 40)
        # A ledger that refuses every append (its stream's subjects are nobody's).
        gone = dataclasses.replace(DEFAULT_LEDGER, stream="JETSERVE_LEDGER_GONE")
        broken = LedgerWriter(js, gone, attempts=1, timeout_s=0.5)
        first = RunSettler(js, store, acct, broken, "gw-a")
        assert await first.settle(run.id) is not None  # charged, not recorded: again
        assert await acct.spend("tenant", "t1", org="t1") == (77, 0)
        second = RunSettler(js, store, acct, LedgerWriter(js), "gw-b")  # the redelivery
        assert await second.settle(run.id) is None
        assert await second.settle(run.id) is None  # once more: still one record
        records = [r async for r in LedgerReader(js).query("t1")]
        assert [(r.request_id, r.charge_micros) for r in records] == [(run.id, 77)]
        assert await acct.spend("tenant", "t1", org="t1") == (77, 0)  # charged once
    finally:
        await rds.aclose()
        await nc.close()

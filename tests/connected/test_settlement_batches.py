"""Group commit of settlements (gateway/inference/settlements.py) on real NATS
and Redis: settlements that arrive together are stored as one outbox message
and deleted with one delete, each charged and recorded once; a batch a frozen
Redis could not apply waits whole in the outbox and a scan applies all of it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis
from nats.aio.client import Client
from nats.js import JetStreamContext

from gateway.inference.settlements import Settlements
from gateway.tenancy.accounting import Accountant
from gateway.tenancy.limits import Scope
from gateway.tenancy.pricing import PriceBook
from gateway.tenancy.records import RecordHead
from gateway.tenancy.request_ledger import LedgerReader, LedgerWriter
from jetserve.services import Service
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.outbox import (
    DEFAULT_OUTBOX,
    Outbox,
    OutboxTopology,
    Settlement,
    decode_settlements,
    ensure_outbox,
)
from streams.request_ledger import DEFAULT_LEDGER, LedgerTopology, ensure_ledger
from streams.wire import Usage
from tests.waits import until

pytestmark = pytest.mark.connected

SCOPE = Scope("demo", "demo", "k1")


@pytest.fixture
async def nc(nats_server: Service) -> AsyncIterator[Client]:
    url = f"nats://127.0.0.1:{nats_server.port}"
    client = await connect(url, "test-settlements", nats_server.bus_auth())
    js = client.jetstream()
    await ensure_ledger(js, DEFAULT_LEDGER)
    await ensure_outbox(js, DEFAULT_OUTBOX)
    yield client
    await client.close()


@pytest.fixture
async def rds(redis_server: Service) -> AsyncIterator[redis.Redis]:
    # A short socket timeout: a frozen Redis fails the settlement, not the test.
    client = redis.Redis.from_url(redis_server.redis_url(), socket_timeout=0.5)
    yield client
    await client.aclose()


def settlement(request_id: str, charge: int) -> Settlement:
    head = RecordHead(SCOPE, request_id, "chat", "interactive", "sim-8b", time.time(), "v1", "gw1")
    record = head.settled(
        policy="admitted",
        attempts=1,
        usage=Usage(3, 5),
        charge_micros=charge,
        reserved_micros=1000,
        outcome="stop",
        status=200,
        duration_ms=1.0,
    )
    return Settlement(record=record, writer="gw1", actual_micros=charge)


async def recorded(nc: Client) -> dict[str, int]:
    """Every ledger record of the tenant: request id -> charge (once each)."""
    out: dict[str, int] = {}
    async for r in LedgerReader(nc.jetstream()).query(SCOPE.tenant):
        assert r.request_id not in out, f"{r.request_id} recorded twice"
        out[r.request_id] = r.charge_micros
    return out


async def stored(nc: Client) -> tuple[int, int]:
    """(messages the outbox ever stored, messages it holds now)."""
    state = (await nc.jetstream().stream_info(DEFAULT_OUTBOX.stream)).state
    return int(state.last_seq), int(state.messages)


async def test_settlements_that_arrive_together_are_one_outbox_message(
    nc: Client, rds: redis.Redis, redis_server: Service
) -> None:
    js = nc.jetstream()
    acct = Accountant(rds, timeout_s=0.5)
    books = Settlements(
        js,
        Outbox(js),
        acct,
        LedgerWriter(js, attempts=2, backoff_s=0.05),
        "gw1",
        DEFAULT_TOPOLOGY,
        PriceBook(),
        grace_s=0.0,
    )
    want = {f"batch-{i:02d}": 100 + i for i in range(20)}
    for rid in want:
        await acct.reserve(SCOPE, rid, 1000, 10)

    # 20 at once: the first commit takes all of them (they were all waiting
    # before the committer ran): one message stored, and (once applied) deleted.
    await asyncio.gather(*(books.settle(settlement(rid, c)) for rid, c in want.items()))
    await books.flush()
    assert await stored(nc) == (1, 0)
    assert await recorded(nc) == want
    for rid, charge in want.items():
        assert await acct.settle(rid, 0, "gw1", org=SCOPE.org) == (
            True,
            charge,
        )  # a repeat: the charge applied

    # Redis frozen: 5 settle together, none can be applied; their one message
    # stays in the outbox, whole.
    later = {f"frozen-{i}": 200 + i for i in range(5)}
    for rid in later:
        await acct.reserve(SCOPE, rid, 1000, 10)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.gather(*(books.settle(settlement(rid, c)) for rid, c in later.items()))
        await books.flush()  # the applies tried (and failed) while it was frozen
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert await stored(nc) == (2, 1)
    msg = await js.get_msg(DEFAULT_OUTBOX.stream, 2)
    assert {s.record.request_id for s in decode_settlements(msg.data or b"")} == set(later)

    # Thawed: a scan applies the whole batch, once, and deletes it.
    async def scanned() -> bool:
        await books.scan()
        return (await stored(nc))[1] == 0

    await until(scanned, "a scan to apply the frozen batch")
    assert await recorded(nc) == {**want, **later}
    await books.aclose()


async def test_a_batch_too_big_for_one_message_is_stored_one_by_one(
    nc: Client, rds: redis.Redis
) -> None:
    """A batch over the outbox's message size goes as single settlements: each
    applied once, the extra messages cleared by a scan."""
    js = nc.jetstream()
    small = OutboxTopology(
        stream="JETSERVE_OUTBOX_SMALL", subject_prefix="jetserve.outboxsmall", max_msg_size=2048
    )
    await ensure_outbox(js, small)
    acct = Accountant(rds, timeout_s=0.5)
    books = Settlements(
        js, Outbox(js, small), acct, LedgerWriter(js, attempts=2, backoff_s=0.05), "gw1",
        DEFAULT_TOPOLOGY, PriceBook(), grace_s=0.0,
    )  # fmt: skip
    want = {f"big-{i}": 300 + i for i in range(6)}  # ~0.6 KiB each: over 2 KiB together
    for rid in want:
        await acct.reserve(SCOPE, rid, 1000, 10)
    await asyncio.gather(*(books.settle(settlement(rid, c)) for rid, c in want.items()))
    await books.flush()
    state = (await js.stream_info(small.stream)).state
    assert state.last_seq == len(want)  # one message each
    assert await recorded(nc) == want

    async def cleared() -> bool:
        await books.scan()
        return (await js.stream_info(small.stream)).state.messages == 0

    await until(cleared, "a scan to clear the single settlements")
    assert await recorded(nc) == want  # applied again by the scan: still once each
    await books.aclose()


async def test_the_caller_goes_on_once_stored_and_the_apply_follows(
    nc: Client, redis_server: Service
) -> None:
    """settle() returns once the outbox holds the settlement, before Redis or the
    ledger is touched: a frozen Redis does not hold the answer up. The gateway
    applies it right after (no scanner involved), and flush() waits for that."""
    patient = redis.Redis.from_url(redis_server.redis_url())  # waits the freeze out
    js = nc.jetstream()
    acct = Accountant(patient, timeout_s=60.0)
    books = Settlements(
        js, Outbox(js), acct, LedgerWriter(js, attempts=2, backoff_s=0.05), "gw1",
        DEFAULT_TOPOLOGY, PriceBook(), grace_s=3600.0,
    )  # fmt: skip
    await acct.reserve(SCOPE, "after-0", 1000, 10)
    last_seq, held = await stored(nc)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await books.settle(settlement("after-0", 123))
        assert await stored(nc) == (last_seq + 1, held + 1)  # durable: in the outbox
        assert "after-0" not in await recorded(nc)  # and not applied yet
        assert not await books.flush(0.2)  # Redis frozen: the apply is waiting on it
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert await books.flush(60.0)
    assert (await recorded(nc))["after-0"] == 123
    assert await stored(nc) == (last_seq + 1, held)  # applied, then deleted
    assert await acct.settle("after-0", 0, "gw1", org=SCOPE.org) == (True, 123)  # charged once
    await books.aclose()
    await patient.aclose()


def books_of(
    js: JetStreamContext, acct: Accountant, ledger: LedgerWriter, gateway: str = "gw1"
) -> Settlements:
    return Settlements(
        js, Outbox(js), acct, ledger, gateway, DEFAULT_TOPOLOGY, PriceBook(), grace_s=0.0
    )


async def held(nc: Client) -> list[list[Settlement]]:
    """The settlements of each message the outbox holds now, oldest first."""
    out = []
    async for p in Outbox(nc.jetstream()).pending():
        assert p.settlements is not None
        out.append(p.settlements)
    return out


async def test_a_batch_applied_in_part_keeps_only_its_rest_in_the_outbox(
    nc: Client, rds: redis.Redis
) -> None:
    """One settlement of a batch cannot be applied for a long while (its org's
    keys unreadable: a Redis Cluster shard down, say); its batch-mate can. The
    scan used to keep the whole batch and apply the mate again at every scan: after
    the ledger's duplicate window (600 s) it was recorded twice. Now the rest is
    stored as a message of its own and the batch deleted."""
    js = nc.jetstream()
    acct = Accountant(rds, timeout_s=0.5)
    books = books_of(js, acct, LedgerWriter(js, attempts=2, backoff_s=0.05))
    stuck_scope = Scope("shard-down", "shard-down", "k2")
    await acct.reserve(SCOPE, "split-good", 1000, 10)
    await acct.reserve(stuck_scope, "split-stuck", 1000, 10)
    head = RecordHead(
        stuck_scope, "split-stuck", "chat", "interactive", "sim-8b", time.time(), "v1", "gw1"
    )
    stuck = Settlement(
        record=head.settled(
            policy="admitted", attempts=1, usage=Usage(3, 5), charge_micros=77,
            reserved_micros=1000, outcome="stop", status=200, duration_ms=1.0,
        ),
        writer="gw1",
        actual_micros=77,
    )  # fmt: skip
    good = settlement("split-good", 66)
    # The stuck org's hold made unreadable (a string where the script wants a hash).
    resv = acct.keys.resv(stuck_scope.org, "split-stuck")
    dumped, ttl = await rds.dump(resv), await rds.pttl(resv)
    assert dumped is not None
    await rds.set(resv, "unreadable")
    _, before = await stored(nc)
    await asyncio.gather(books.settle(stuck), books.settle(good))  # one batch
    await books.flush()
    assert (await stored(nc))[1] == before + 1  # the inline apply left it whole

    # Two gateways' scanners at once (every gateway scans every gateway's outbox):
    # the rest is stored once, whoever stores it.
    other = books_of(js, acct, LedgerWriter(js, attempts=2, backoff_s=0.05), "gw2")
    await asyncio.gather(books.scan(), other.scan())
    assert await held(nc) == [[stuck]]  # the applied mate is not kept with it
    assert (await recorded(nc))["split-good"] == 66

    await rds.restore(resv, ttl, dumped, replace=True)  # the shard is back
    await books.scan()
    assert await held(nc) == []
    recs = {r.request_id: r.charge_micros async for r in LedgerReader(js).query("shard-down")}
    assert recs == {"split-stuck": 77}
    assert (await recorded(nc))["split-good"] == 66  # once (recorded() checks)
    await books.aclose()
    await other.aclose()


async def test_a_settlement_charged_but_not_recorded_keeps_its_charge(
    nc: Client, rds: redis.Redis
) -> None:
    """Redis charged a settlement; the ledger did not take its record for longer
    than Redis keeps the done marker (30 min). Applied again whole, it found no
    hold and no marker and was recorded charged 0. What is left after the charge
    is the record with its charge, and only that is applied again."""
    js = nc.jetstream()
    late = LedgerTopology(stream="JETSERVE_LEDGER_LATE", subject_prefix="jetserve.ledgerlate")
    acct = Accountant(rds, timeout_s=0.5)
    books = books_of(js, acct, LedgerWriter(js, late, attempts=2, backoff_s=0.05))
    await acct.reserve(SCOPE, "charged-unrecorded", 1000, 10)
    await books.settle(settlement("charged-unrecorded", 250))  # the ledger has no stream yet
    await books.flush()
    await books.scan()
    assert len(await held(nc)) == 1  # waiting for the ledger
    await rds.delete(acct.keys.done(SCOPE.org, "charged-unrecorded"))  # the marker expired

    await ensure_ledger(js, late)  # the ledger is back
    await books.scan()
    assert await held(nc) == []
    recs = [r async for r in LedgerReader(js, late).query(SCOPE.tenant)]
    assert [(r.request_id, r.charge_micros) for r in recs] == [("charged-unrecorded", 250)]
    await books.aclose()

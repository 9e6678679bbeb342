"""The settlement outbox's scanner (gateway/inference/settlements.py): what a
gateway left unapplied is applied by any replica, once; what cannot be read is
dead-lettered, not retried forever."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
from nats.js.errors import NotFoundError

from gateway.errors import RateLimited
from gateway.tenancy.limits import Scope
from gateway.tenancy.records import RecordHead
from jetserve.fleet import Fleet
from streams.outbox import (
    DEFAULT_OUTBOX,
    Outbox,
    Settlement,
    SettlementBatch,
    decode_settlements,
)
from streams.subjects import dlq_subject
from tests.waits import until

pytestmark = pytest.mark.connected

FAST_BOOKS = ["--outbox-scan", "0.2", "--outbox-grace", "0.5"]


def ledger_of(fleet: Fleet, request_id: str) -> list[dict[str, object]]:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    rows = [msgspec.json.decode(line) for line in text.splitlines() if line]
    return [r for r in rows if r["request_id"] == request_id]


async def test_a_dead_gateways_record_is_applied_once_and_poison_is_dead_lettered(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1, gateway_args=FAST_BOOKS)
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        outbox = Outbox(js)
        head = RecordHead(
            scope=Scope(fleet.spec.tenant, fleet.spec.tenant, "k"),
            request_id="refused-by-a-dead-gateway",
            op="chat",
            cls="interactive",
            model="sim-8b",
            created=time.time(),
            price_version="v1",
            gateway="gwdead000000",
        )
        full = RateLimited("The request queue is full.", code="queue_full", retry_after=1.0)
        record = head.refused("rejected:queue_full", full)
        # Stored twice, as a gateway whose publish ack was lost would: one record.
        await outbox.publish("gwdead000000", Settlement(record=record, writer="gwdead000000"))
        await outbox.publish("gwdead000000", Settlement(record=record, writer="gwdead000000"))
        ack = await js.publish(
            DEFAULT_OUTBOX.subject("gwdead000000"),
            b"not a settlement",
            stream=DEFAULT_OUTBOX.stream,
        )

        async def drained() -> bool:
            return await outbox.count() == 0

        await until(drained, "the scanner to drain the outbox")
        assert len(ledger_of(fleet, record.request_id)) == 1
        dead = await js.get_last_msg(
            "JETSERVE_DLQ", dlq_subject(DEFAULT_OUTBOX.subject("gwdead000000"))
        )
        assert dead.data == b"not a settlement"
        assert dead.headers is not None
        assert dead.headers["Jetserve-Dlq-Seq"] == str(ack.seq)
        with pytest.raises(NotFoundError):
            await js.get_msg(DEFAULT_OUTBOX.stream, ack.seq)
    finally:
        await nc.close()


async def test_a_settlement_no_store_takes_is_set_aside_and_the_rest_applied(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A decodable settlement the ledger will never take (its tenant id is not a
    subject token: a bug's, or an old gateway's) used to stop the scanner at it for
    good (the error escaped its loop): nothing stored after it was applied again.
    It is dead-lettered now, and the next one applied."""
    fleet = make_fleet(workers=0, gateway_args=FAST_BOOKS)
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        outbox = Outbox(js)
        full = RateLimited("The request queue is full.", code="queue_full", retry_after=1.0)

        def refused(tenant: str, request_id: str) -> Settlement:
            head = RecordHead(
                scope=Scope(tenant, tenant, "k"), request_id=request_id, op="chat",
                cls="interactive", model="sim-8b", created=time.time(), price_version="v1",
                gateway="gwbug0000000",
            )  # fmt: skip
            return Settlement(record=head.refused("rejected:queue_full", full), writer="gwbug")

        poison = refused("no such.tenant", "poisoned")
        # In a batch, before a good one; then a message of its own after it.
        batch = SettlementBatch(settlements=[poison, refused(fleet.spec.tenant, "beside-it")])
        bad = await outbox.publish_batch("gwbug0000000", batch, "batch:gwbug:1")
        await outbox.publish("gwbug0000000", refused(fleet.spec.tenant, "after-the-poison"))

        async def applied() -> bool:
            return all(len(ledger_of(fleet, i)) == 1 for i in ("beside-it", "after-the-poison"))

        await until(applied, "the settlements beside and after the poisoned one applied")
        dead = await js.get_last_msg(
            "JETSERVE_DLQ", dlq_subject(DEFAULT_OUTBOX.subject("gwbug0000000"))
        )
        assert dead.headers is not None
        assert dead.headers["Jetserve-Dlq-Seq"] == str(bad)
        assert decode_settlements(dead.data or b"") == [poison]  # alone: its batch-mate applied
        assert await outbox.count() == 0
    finally:
        await nc.close()


async def test_an_applied_settlement_is_removed_and_a_second_removal_is_a_no_op(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Removal writes a tombstone (no_erase): the message is gone all the same,
    # and a scanner that removes it again after another one did is not an error.
    fleet = make_fleet(workers=0)
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        outbox = Outbox(js)
        head = RecordHead(
            scope=Scope(fleet.spec.tenant, fleet.spec.tenant, "k"), request_id="removed-once",
            op="chat", cls="interactive", model="sim-8b", created=time.time(),
            price_version="v1", gateway="gwremove0000",
        )  # fmt: skip
        full = RateLimited("The request queue is full.", code="queue_full", retry_after=1.0)
        seq = await outbox.publish(
            "gwremove0000",
            Settlement(record=head.refused("rejected:queue_full", full), writer="gwremove0000"),
        )
        assert (await js.get_msg(DEFAULT_OUTBOX.stream, seq)).seq == seq
        await outbox.delete(seq)
        with pytest.raises(NotFoundError):
            await js.get_msg(DEFAULT_OUTBOX.stream, seq)
        await outbox.delete(seq)  # already gone: fine
    finally:
        await nc.close()

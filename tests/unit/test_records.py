"""A hold's note: the record's head kept with the hold, read back by the orphan sweep."""

from __future__ import annotations

from gateway.tenancy.accounting import MAX_WHAT, ExpiredHold
from gateway.tenancy.limits import Scope
from gateway.tenancy.records import GATEWAY_LOST, RecordHead


def _head(model: str = "sim-8b", request_id: str = "req-1") -> RecordHead:
    return RecordHead(
        scope=Scope("acme", "team-a", "key-1"),
        request_id=request_id,
        op="chat",
        cls="interactive",
        model=model,
        created=1_700_000_000.25,
        price_version="v7",
        gateway="gw-1",
        route="support",
        route_revision=3,
        rollout_arm="canary",
    )


def test_a_note_reads_back_as_its_head_in_the_org_the_hold_names() -> None:
    head = _head()
    hold = ExpiredHold("acme-moved", "team-a", "req-1", cost_micros=500, what=head.note())
    back = RecordHead.of_hold(hold)
    assert back is not None
    assert back.scope == Scope("acme-moved", "team-a", "key-1")
    assert (back.request_id, back.model, back.route, back.rollout_arm) == (
        "req-1",
        "sim-8b",
        "support",
        "canary",
    )
    record = back.unqueued(hold.cost_micros)
    assert (record.policy, record.outcome, record.status) == (
        "admitted:released",
        GATEWAY_LOST,
        502,
    )
    assert (record.charge_micros, record.reserved_micros, record.attempts) == (0, 500, 0)
    assert record.created == head.created


def test_no_note_a_bad_note_or_another_requests_note_gives_no_head() -> None:
    assert RecordHead.of_hold(ExpiredHold("acme", "team-a", "req-1")) is None  # an older gateway
    assert RecordHead.of_hold(ExpiredHold("acme", "team-a", "req-1", what="{not json")) is None
    other = _head(request_id="req-2").note()
    assert RecordHead.of_hold(ExpiredHold("acme", "team-a", "req-1", what=other)) is None


def test_a_note_too_long_is_left_out_rather_than_failing_the_request() -> None:
    assert _head(model="m" * MAX_WHAT).note() == ""
    assert 0 < len(_head().note()) < MAX_WHAT

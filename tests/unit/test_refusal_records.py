"""Which refusals get a ledger record each, and the summaries of the rest."""

from __future__ import annotations

from gateway.errors import BadRequest
from gateway.tenancy.accounting import Scope
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.records import RecordHead
from gateway.tenancy.refusal_records import MAX_TENANTS, SUMMARY_PREFIX, RefusalRecords
from streams.request_ledger import LedgerRecord


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refusal(tenant: str = "acme", model: str = "m1", n: int = 0) -> LedgerRecord:
    key = KeyRecord(key_id=f"key_{tenant}", tenant=tenant)
    head = RecordHead(
        request_id=f"{n:032x}",
        scope=Scope.of(key),
        op="chat",
        cls="interactive",
        model=model,
        created=1.0 + n,
        price_version="p1",
        gateway="gw-1",
    )
    return head.refused("rejected:rate", BadRequest("slow down", code="rate_limited"))


def test_a_burst_each_then_the_rate_then_counted() -> None:
    clock = Clock()
    books = RefusalRecords(per_s=2.0, burst=3, window_s=10.0, clock=clock)
    assert [books.take(refusal(n=i)) for i in range(5)] == [True, True, True, False, False]
    clock.now += 0.5  # one more record's worth of rate
    assert [books.take(refusal(n=i)) for i in range(5, 7)] == [True, False]
    assert books.due() == []  # the window of the first counted one is not over
    clock.now += 10.0
    (summary,) = books.due()
    assert summary.count == 3
    assert summary.request_id.startswith(SUMMARY_PREFIX)
    assert (summary.created, summary.outcome) == (4.0, "rate_limited")
    assert summary.policy == "rejected:rate"
    assert books.due() == books.drain() == []  # counted once


def test_each_tenant_has_its_own_bucket_and_summary() -> None:
    clock = Clock()
    books = RefusalRecords(per_s=0.0, burst=1, window_s=1.0, clock=clock)
    for tenant in ("acme", "globex"):
        assert books.take(refusal(tenant))
        assert not books.take(refusal(tenant))
        assert not books.take(refusal(tenant, model="m2"))
    summaries = {s.tenant: s for s in books.drain()}
    assert {t: (s.count, s.model) for t, s in summaries.items()} == {
        "acme": (2, ""),  # two models: the summary names none
        "globex": (2, ""),
    }


def test_forgotten_tenants_are_bounded() -> None:
    clock = Clock()
    books = RefusalRecords(per_s=0.0, burst=1, window_s=1.0, clock=clock)
    for n in range(MAX_TENANTS + 5):
        assert books.take(refusal(f"t{n}"))
    assert len(books._buckets) == MAX_TENANTS
    assert books.take(refusal("t0"))  # the oldest was forgotten: a full bucket again
    assert not books.take(refusal(f"t{MAX_TENANTS + 4}"))  # a recent one was not

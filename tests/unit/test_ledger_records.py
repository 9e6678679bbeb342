"""The one ledger-record builder: every kind of record names its payer the same way."""

from __future__ import annotations

from gateway.errors import BadRequest
from gateway.tenancy.accounting import Scope
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.records import RecordHead, Serving
from streams.wire import Usage


def head(key: KeyRecord) -> RecordHead:
    return RecordHead(
        scope=Scope.of(key),
        request_id="req_1",
        op="chat",
        cls="interactive",
        model="sim-8b",
        created=1.0,
        price_version="p1",
        gateway="gw-1",
    )


def test_a_key_outside_any_org_pays_as_its_tenant() -> None:
    # A key stored before orgs existed decodes with org="" (the field's default).
    key = KeyRecord(key_id="key_1", tenant="acme")
    refused = head(key).refused("rejected:budget", BadRequest("no", code="budget_exceeded"))
    served = head(key).settled(
        policy="admitted",
        attempts=1,
        usage=Usage(3, 4),
        charge_micros=7,
        reserved_micros=9,
        outcome="stop",
        status=200,
        duration_ms=5.0,
        serving=Serving(worker="w1", first_token_ms=1.5),
    )
    assert refused.org == served.org == "acme"
    assert (refused.charge_micros, refused.attempts, refused.outcome) == (0, 0, "budget_exceeded")
    assert (served.worker, served.first_token_ms, served.gateway) == ("w1", 1.5, "gw-1")


def test_a_key_in_an_org_pays_as_the_org() -> None:
    key = KeyRecord(key_id="key_1", tenant="acme", org="holding")
    assert head(key).refused("rejected:rate", BadRequest("no")).org == "holding"

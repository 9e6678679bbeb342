"""Requests in flight per tenant over NATS (gateway/tenancy/tenant_slots.py): the
bound each NATS ingress (inference, runs) keeps, of the same size."""

from __future__ import annotations

import pytest

from gateway.errors import RateLimited
from gateway.tenancy.tenant_slots import TenantSlots


def test_a_tenant_past_its_bound_is_refused_and_its_slots_come_back() -> None:
    slots = TenantSlots(2)
    slots.enter("a")
    with slots.held("a"):
        with pytest.raises(RateLimited) as refused:
            slots.enter("a")
        assert refused.value.code == "too_many_inflight"
        slots.enter("b")  # another tenant's are its own
    with pytest.raises(ValueError, match="boom"), slots.held("a"):  # given back on errors
        raise ValueError("boom")
    slots.enter("a")
    slots.leave("a")
    slots.leave("a")
    slots.leave("b")
    assert not slots._inflight  # nothing kept for tenants with none in flight

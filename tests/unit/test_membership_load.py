"""What a member says of itself in the bucket (its deployment and load), and
the bounded-load rule a lane owner applies with it (streams/membership.py)."""

from __future__ import annotations

from typing import Any, cast

import msgspec

from streams.membership import (
    HOT_FACTOR,
    HOT_SLACK,
    Adapter,
    MemberInfo,
    Membership,
    member_info,
)
from streams.pools import adapter_pool
from workers.inference.affinity import StartRate


def test_a_members_value_reads_back_new_and_old() -> None:
    assert member_info(msgspec.json.encode(MemberInfo("dep-a", 2.5))) == MemberInfo("dep-a", 2.5)
    assert member_info(b"dep-a") == MemberInfo("dep-a")  # a worker of before loads
    assert member_info(b"") == MemberInfo()
    assert member_info(None) == MemberInfo()


def view(me: float, others: dict[str, float], deployment: str = "") -> Membership:
    m = Membership(cast(Any, None), "w0", 1, load=lambda: me, deployment=deployment)
    m.members = tuple(sorted({"w0", *others}))
    m.loads = dict(others)
    if deployment:
        m.pools = {deployment: m.members}
    return m


def test_an_owner_well_above_its_pools_mean_is_hot() -> None:
    # Three at 1 req/s and this one at 5: the mean is 2, 5 > 1.25 * 2 + 0.5.
    assert view(5.0, {"w1": 1.0, "w2": 1.0, "w3": 1.0}).hot()
    # Near the mean, or everyone idle: not hot.
    assert not view(1.2, {"w1": 1.0, "w2": 1.0, "w3": 1.0}).hot()
    assert not view(0.4, {"w1": 0.0, "w2": 0.0}).hot()  # the slack: idle noise
    # Alone: nobody to let go first.
    assert not view(50.0, {}).hot()
    # A pool's mean is its own members'.
    pooled = view(4.0, {"w1": 4.0}, deployment="dep-a")
    pooled.pools["dep-b"] = ("w9",)
    assert not pooled.hot("dep-a")
    # The rule's edge: just past factor x mean + slack.
    mean = 2.0
    edge = HOT_FACTOR * mean + HOT_SLACK
    others = {"w1": mean, "w2": mean}
    assert not view(mean, others).hot()
    assert view(3 * edge, {"w1": 0.0, "w2": 0.0}).hot()


def test_the_start_rate_is_a_decaying_average() -> None:
    rate = StartRate(tau_s=10.0)
    assert rate.value() == 0.0
    for _ in range(20):
        rate.tick()
    assert 1.9 < rate.value() <= 2.0  # 20 starts at once, over a 10 s time constant


def test_a_members_adapters_make_pools_and_newer_fields_are_left_out() -> None:
    info = MemberInfo("dep-a", 1.0, ("sim-8b",), (Adapter("sql-lora", "sim-8b"),), "vllm 0.1")
    assert member_info(msgspec.json.encode(info)) == info
    assert info.pools() == ("dep-a", adapter_pool("dep-a", "sql-lora"))
    assert MemberInfo("", 0.0, (), (Adapter("x", "m"),)).pools() == ()  # no deployment
    # A worker newer than this reader: the fields it does not know are skipped.
    newer = b'["dep-a", 1.0, ["sim-8b"], [["sql-lora", "sim-8b"]], "vllm 0.1", {"later": 1}]'
    assert member_info(newer) == info
    # A worker of before adapters: two fields.
    assert member_info(b'["dep-a", 1.0]') == MemberInfo("dep-a", 1.0)

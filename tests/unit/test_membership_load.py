"""What a member says of itself in the bucket (its deployment and load), and
the bounded-load rule a lane owner applies with it (streams/membership.py)."""

from __future__ import annotations

from typing import Any, cast

import msgspec

from streams.balance import BALANCE, HOT_PRIORITY
from streams.membership import MAX_PRIORITY, Adapter, MemberInfo, Membership, member_info
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


def test_a_worker_well_above_its_pools_mean_pulls_last() -> None:
    # Three at 1 req/s and this one at 5: hot, its pulls behind every backup's.
    assert view(5.0, {"w1": 1.0, "w2": 1.0, "w3": 1.0}).pull_priority(0) >= HOT_PRIORITY
    # Near the mean: the owner first, a backup after it.
    near = view(1.1, {"w1": 1.0, "w2": 1.0, "w3": 1.0})
    assert near.pull_priority(0) < near.pull_priority(1) < HOT_PRIORITY
    # Everyone idle, or alone whatever its load: the rank alone decides.
    idle = view(0.0, {"w1": 0.0, "w2": 0.0})
    alone = view(50.0, {})
    assert [idle.pull_priority(r) for r in range(3)] == [3, 4, 5]
    assert [alone.pull_priority(r) for r in range(3)] == [3, 4, 5]
    assert alone.pull_priority(12) <= MAX_PRIORITY
    # A pool's mean is its own members': two alike in dep-a, a busier one elsewhere.
    pooled = view(4.0, {"w1": 4.0, "w9": 40.0}, deployment="dep-a")
    pooled.pools = {"dep-a": ("w0", "w1"), "dep-b": ("w9",)}
    assert pooled.mean_load("dep-a") == 4.0
    assert pooled.pull_priority(0, "dep-a") < pooled.pull_priority(1, "dep-a") < HOT_PRIORITY


def test_the_members_mean_counts_this_worker_as_it_is_now() -> None:
    m = view(0.9, {"w1": 0.3, "w2": 0.3})
    assert m.mean_load() == 0.5
    assert m.pull_priority(0) == BALANCE.priority(0, 0.9, 0.5)


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
    newer = (
        b'["dep-a", 1.0, ["sim-8b"], [["sql-lora", "sim-8b"]], "vllm 0.1", ["interactive"],'
        b' {"later": 1}]'
    )
    assert member_info(newer) == msgspec.structs.replace(info, classes=("interactive",))
    # One of before classes: it serves every class.
    assert info.serves("batch")
    assert not member_info(newer).serves("batch")
    # A worker of before adapters: two fields.
    assert member_info(b'["dep-a", 1.0]') == MemberInfo("dep-a", 1.0)

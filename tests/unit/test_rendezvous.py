"""Lane ownership by rendezvous hashing with bounded load (streams/rendezvous.py)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from jetserve.bench.fleet.scale import Lanes
from streams.definitions import Topology
from streams.rendezvous import DEFAULT_DEPTH, DEFAULT_LOAD_FACTOR, assign, weight


def fleet(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}-{i:03d}" for i in range(n)]


def owned(order_lanes: int, members: list[str]) -> Counter[str]:
    order = assign(members, order_lanes)
    return Counter(order.owner(lane) for lane in range(order_lanes))


@pytest.mark.parametrize("n", [4, 16, 20, 64, 100])
def test_no_member_owns_past_its_bounded_share(n: int) -> None:
    lanes = 256
    counts = owned(lanes, fleet(n))
    assert sum(counts.values()) == lanes
    assert max(counts.values()) <= math.ceil(DEFAULT_LOAD_FACTOR * lanes / n)
    # With lanes to spare, (nearly) every member owns some: 16 lanes a class
    # used to cap a class at 16 replicas.
    assert len(counts) >= min(n, lanes) * 0.95


@pytest.mark.parametrize(("before", "after"), [(64, 65), (64, 63), (16, 17), (100, 99)])
def test_one_member_joining_or_leaving_moves_about_one_nth(before: int, after: int) -> None:
    lanes = 256
    everyone = fleet(max(before, after))
    a = assign(everyone[:before], lanes)
    b = assign(everyone[:after], lanes)
    n = max(before, after)
    # ~1/n (plus a little where the bounded cap steps): never a reshuffle.
    assert a.moved(b) <= 2.5 / n, a.moved(b)
    # The 64 -> 65 / 64 -> 63 measure of issue 16: at most 3 % of lanes move.
    if before == 64:
        assert a.moved(b) <= 0.03


def test_everyone_computes_the_same_order_from_the_same_members() -> None:
    members = fleet(20)
    shuffled = members[:]
    random.Random(7).shuffle(shuffled)
    assert assign(members, 64) == assign(shuffled + members[:3], 64)


def test_each_lane_ranks_distinct_members_owner_first() -> None:
    members = fleet(10)
    order = assign(members, 32, depth=DEFAULT_DEPTH)
    for lane in range(32):
        ranked = order.orders[lane]
        assert len(ranked) == DEFAULT_DEPTH == len(set(ranked))
        assert order.rank(ranked[0], lane) == 0
        assert order.rank(ranked[2], lane) == 2
        outsider = next(m for m in members if m not in ranked)
        assert order.rank(outsider, lane) is None
    # A member pulls only the lanes it ranks: about depth/n of them.
    pulled = [len(order.ranked_lanes(m)) for m in members]
    assert sum(pulled) == 32 * DEFAULT_DEPTH


def test_a_dead_owners_lanes_go_mostly_to_their_backups() -> None:
    """Failover needs no new pulls: a lane's next owner is (nearly always)
    already pulling it as a backup; the bounded cap may send a few elsewhere."""
    members = fleet(64)
    a = assign(members, 256)
    kept = total = 0
    for gone in members[:16]:
        b = assign([m for m in members if m != gone], 256)
        lanes = [lane for lane in range(256) if a.owner(lane) == gone]
        total += len(lanes)
        kept += sum(b.owner(lane) in a.orders[lane][1:] for lane in lanes)
        assert all(b.owner(lane) != gone for lane in lanes)
    assert kept >= 0.75 * total, (kept, total)


def test_degenerate_inputs() -> None:
    assert assign([], 8).orders == tuple(() for _ in range(8))
    assert assign(["only"], 4).orders == (("only",),) * 4
    with pytest.raises(ValueError, match="load_factor"):
        assign(fleet(3), 8, load_factor=0.5)


def test_the_stream_records_the_load_factor_and_a_legacy_stream_has_the_default() -> None:
    recorded = Topology(lane_load_factor=1.3).lane_metadata()
    assert Topology().with_stream_lanes(recorded).lane_load_factor == 1.3
    assert Topology(lane_load_factor=2.0).with_stream_lanes({}).lane_load_factor == (
        DEFAULT_LOAD_FACTOR
    )
    for bad in (0.9, 4.5):
        with pytest.raises(ValueError, match="lane_load_factor"):
            Topology(lane_load_factor=bad)


def test_512_lanes_at_1_3_keep_the_benchs_changes_within_3_percent() -> None:
    """The fleet bench's 64 members and its joiner (jetserve/bench/fleet/scale.py):
    at 256 lanes the join moves 8 (3.1 %), over issue 16's 3 %; 512 lanes at
    load factor 1.3 is the setting docs/routing.md gives for fleets of 64 and up."""
    base = [*[f"worker{w}-bench-{e}" for w in range(8) for e in range(8)][:63], "worker8-bench"]
    joined, left = [*base, "worker9-bench"], base[:-1]
    at_256 = Lanes(256, DEFAULT_LOAD_FACTOR)
    assert at_256.moved(base, joined) == 0.0312
    at_512 = Lanes(512, 1.3)
    moves = [at_512.moved(base, joined), at_512.moved(joined, base), at_512.moved(base, left)]
    assert all(m is not None and m <= 0.03 for m in moves), moves


def _reference(
    members: list[str], lanes: int, depth: int, load_factor: float
) -> list[tuple[str, ...]]:
    """The rule as stated: every (member, lane) pair sorted heaviest first, each
    taken when its lane is unowned and its member has room."""
    names = sorted(set(members))
    cap = math.ceil(load_factor * lanes / len(names))
    pairs = sorted(((weight(m, n), n, m) for n in range(lanes) for m in names), reverse=True)
    owner: dict[int, str] = {}
    owned = Counter[str]()
    for _, lane, m in pairs:
        if lane not in owner and owned[m] < cap:
            owner[lane], owned[m] = m, owned[m] + 1
    out = []
    for lane in range(lanes):
        ranked = [m for _, m in sorted(((weight(m, lane), m) for m in names), reverse=True)]
        out.append((owner[lane], *[m for m in ranked if m != owner[lane]][: max(depth - 1, 0)]))
    return out


def test_the_assignment_is_the_heaviest_pair_first_rule() -> None:
    """assign() takes one candidate per lane from a heap, and caches members'
    weights and whole assignments: the owners and backups are the rule's."""
    rng = random.Random(7)
    for _ in range(60):
        members = [f"m{rng.randrange(10**6)}" for _ in range(rng.randint(1, 70))]
        lanes, depth = rng.choice([1, 3, 16, 64, 256]), rng.randint(0, 5)
        load_factor = rng.choice([1.0, 1.1, 1.4, 2.0])
        order = assign(members, lanes, depth, load_factor)
        assert list(order.orders) == _reference(members, lanes, depth, load_factor)

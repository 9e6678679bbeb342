"""The gateway's KV index: bounded, per replica, forgetting what it can no longer trust."""

from __future__ import annotations

from gateway.inference.kv_index import KvIndex
from gateway.inference.kv_routing import KvRouting
from streams.definitions import DEFAULT_TOPOLOGY
from streams.kv_index import KvIndexDelta, PrefixKey
from streams.membership import Membership
from streams.rendezvous import assign


def test_the_longest_held_prefix_and_its_holders() -> None:
    index = KvIndex()
    index.apply(KvIndexDelta("a", added=(1, 2)))
    index.apply(KvIndexDelta("b", added=(1, 2, 3)))
    assert index.longest([1, 2, 3, 4], {"a", "b"}) == (3, ["b"])
    assert index.longest([1, 2, 3, 4], {"a"}) == (2, ["a"])  # b is not a member
    assert index.longest([9], {"a", "b"}) == (0, [])
    index.apply(KvIndexDelta("b", removed=(3,)))
    assert index.longest([1, 2, 3], {"a", "b"}) == (2, ["a", "b"])
    assert index.entries == 4


def test_a_refresh_replaces_and_silence_or_leaving_forgets() -> None:
    now = [0.0]
    index = KvIndex(ttl_s=10.0, clock=lambda: now[0])
    index.apply(KvIndexDelta("a", added=(1, 2)))
    index.apply(KvIndexDelta("b", added=(1,)))
    index.apply(KvIndexDelta("a", added=(2, 5), refresh=True))
    assert index.longest([1], {"a", "b"}) == (1, ["b"])
    index.retain({"a"})  # b left the members
    assert index.longest([1], {"a", "b"}) == (0, [])
    assert index.replicas == 1
    now[0] = 11.0  # a, silent past the TTL
    assert index.longest([2], {"a"}) == (0, [])
    index.retain({"a"})
    assert index.entries == 0


def test_bounded_least_recently_used_first() -> None:
    index = KvIndex(max_entries=3)
    index.apply(KvIndexDelta("a", added=(1, 2, 3)))
    index.longest([1], {"a"})  # 1 used: 2 is now the least recent
    index.apply(KvIndexDelta("a", added=(4,)))
    assert index.entries == 3
    assert index.longest([2], {"a"}) == (0, [])
    assert index.longest([1], {"a"}) == (1, ["a"])


def _routing(members: tuple[str, ...]) -> tuple[KvRouting, list[str]]:
    counted: list[str] = []
    routing = KvRouting(None, None, DEFAULT_TOPOLOGY, counted.append)  # type: ignore[arg-type]
    view = Membership(None, None, 1)  # type: ignore[arg-type]
    view.members = members
    routing._members = view
    routing.prepare(32)
    return routing, counted


def test_routing_goes_to_a_lane_the_holder_owns() -> None:
    routing, counted = _routing(("a", "b", "c"))
    keys = [PrefixKey(11, 0.3), PrefixKey(12, 0.6)]
    order = assign(["a", "b", "c"], 32)
    hash_lane = next(lane for lane in range(32) if order.owner(lane) == "a")
    assert routing.lane(32, keys, hash_lane) == hash_lane  # cold: its hash lane
    routing.index.apply(KvIndexDelta("b", added=(11, 12)))
    lane = routing.lane(32, keys, hash_lane)
    assert order.owner(lane) == "b"
    routing.index.apply(KvIndexDelta("a", added=(11,)))
    assert routing.lane(32, keys, hash_lane) == lane  # b holds more of it
    routing.index.apply(KvIndexDelta("b", removed=(11, 12)))
    assert routing.lane(32, keys, hash_lane) == hash_lane  # a holds it, and owns its lane
    assert counted == ["hash", "index", "index", "index"]

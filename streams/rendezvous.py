"""Lane ownership: rendezvous (highest-random-weight) hashing with bounded load.

Every lane ranks every member by a hash of (member, lane); the highest weight
is the lane's first choice. Owners are then matched greedily, heaviest pair
first, with each member owning at most ``ceil(load_factor * lanes / members)``
lanes (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded
Loads", 2018). So

- one member joining or leaving moves about ``1/n`` of the lanes: a lane's
  order among the others does not depend on who else is there. A cascade
  follows only when the cap steps (``ceil`` of ``load_factor * lanes / n``
  changes with ``n``): members that were full take back lanes they rank first.
- no member owns more than the cap, however the hashes fall (plain rendezvous
  over 256 lanes and 64 members gives the busiest ~2.5x the mean).

Behind the owner, each lane lists its next ``depth - 1`` members by weight: the
pulls that take a lane's spill (the owner is full) and its failover (the owner
died). Everyone computes the same assignment from the same member set: no
coordination beyond the membership bucket.

Cost. Workers compute it on their pull loop at every membership change, once
per engine they drive. Sorting all ``members x lanes`` pairs took ~45 ms for
64 members and 512 lanes on an idle core (several times that on a loaded one),
and a 64-replica fleet of 8-engine workers never finished starting at 512
lanes: each change cost a process ~0.4 s of CPU, heartbeats went late, members
expired, and more changes came. Now each lane's members are sorted on their
own and each lane keeps one candidate in a heap (the same pairs in the same
order), members' weights are hashed once, and a process's engines share one
assignment per member set: ~8 ms after a join at 64 x 512.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_DEPTH = 4
# 1.4 keeps a 256-lane class's cap at 6 from 60 to 66 members: moves near 1/n
# there (docs/routing.md gives the measured moves across fleet sizes).
DEFAULT_LOAD_FACTOR = 1.4


def weight(member: str, lane: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{member}\0{lane}".encode(), digest_size=8).digest())


@functools.lru_cache(maxsize=1024)
def _weights(member: str, lanes: int) -> array[int]:
    """``member``'s weight on every lane: a member's weights never change, so a
    membership change hashes only the newcomers (8 bytes a lane: 1024 members of
    512 lanes hold 4 MB)."""
    return array("Q", (weight(member, lane) for lane in range(lanes)))


@dataclass(frozen=True)
class LaneOrder:
    """Who serves each lane, in priority order (owner first)."""

    members: tuple[str, ...]
    orders: tuple[tuple[str, ...], ...]  # per lane: owner, then backups

    def owner(self, lane: int) -> str:
        return self.orders[lane][0]

    def rank(self, member: str, lane: int) -> int | None:
        """0 for the lane's owner, 1 for its first backup, ...; None: not ranked."""
        order = self.orders[lane]
        return order.index(member) if member in order else None

    def ranked_lanes(self, member: str) -> list[int]:
        return [lane for lane, order in enumerate(self.orders) if member in order]

    def moved(self, other: LaneOrder) -> float:
        """The share of lanes whose owner differs in ``other``."""
        pairs = list(zip(self.orders, other.orders, strict=True))
        return sum(a[:1] != b[:1] for a, b in pairs) / max(len(pairs), 1)  # a lane may be unowned


def assign(
    members: Sequence[str],
    lanes: int,
    depth: int = DEFAULT_DEPTH,
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> LaneOrder:
    """The owners and backups of ``lanes`` lanes among ``members``."""
    names = tuple(sorted(set(members)))
    if not names or lanes <= 0:
        return LaneOrder(names, tuple(() for _ in range(max(lanes, 0))))
    if load_factor < 1.0:
        raise ValueError("load_factor must be at least 1")
    return _assign(names, lanes, depth, load_factor)


# The engines a worker process drives each follow the same members: one
# assignment serves them all (it is the costly part of a membership change).
@functools.lru_cache(maxsize=16)
def _assign(names: tuple[str, ...], lanes: int, depth: int, load_factor: float) -> LaneOrder:
    cap = math.ceil(load_factor * lanes / len(names))
    rows = [_weights(m, lanes) for m in names]
    # Per lane, the members heaviest first (ties: the later name first).
    ranked = [
        [m for _, m in sorted(zip((r[lane] for r in rows), names, strict=True), reverse=True)]
        for lane in range(lanes)
    ]
    weights = dict(zip(names, rows, strict=True))
    # Heaviest (member, lane) pair first: a lane goes to its first choice unless
    # that member is full, then to its next, and so on. Each lane keeps one
    # candidate in the heap, its heaviest member not yet found full: the heap's
    # top is the heaviest pair of a lane still unowned.
    heap = [(-weights[ranked[lane][0]][lane], -lane, 0) for lane in range(lanes)]
    heapq.heapify(heap)
    owner: list[str] = [""] * lanes
    owned = dict.fromkeys(names, 0)
    while heap:
        _, neg_lane, pos = heapq.heappop(heap)
        lane = -neg_lane
        member = ranked[lane][pos]
        if owned[member] < cap:
            owner[lane] = member
            owned[member] += 1
        else:  # full for good (counts only grow): the lane's next choice
            nxt = ranked[lane][pos + 1]  # cap * members >= lanes: someone has room
            heapq.heappush(heap, (-weights[nxt][lane], neg_lane, pos + 1))
    orders = []
    for lane, order in enumerate(ranked):
        first = owner[lane]
        backups = [m for m in order if m != first][: max(depth - 1, 0)]
        orders.append((first, *backups))
    return LaneOrder(names, tuple(orders))

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
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_DEPTH = 4
# 1.4 keeps a 256-lane class's cap at 6 from 60 to 66 members: moves near 1/n
# there (docs/routing.md gives the measured moves across fleet sizes).
DEFAULT_LOAD_FACTOR = 1.4


def weight(member: str, lane: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{member}\0{lane}".encode(), digest_size=8).digest())


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
    cap = math.ceil(load_factor * lanes / len(names))
    weights = [[(weight(m, lane), m) for m in names] for lane in range(lanes)]
    # Heaviest (member, lane) pair first: a lane goes to its first choice unless
    # that member is full, then to its next, and so on.
    pairs = sorted(((w, lane, m) for lane, row in enumerate(weights) for w, m in row), reverse=True)
    owner: list[str | None] = [None] * lanes
    owned = dict.fromkeys(names, 0)
    left = lanes
    for _, lane, member in pairs:
        if owner[lane] is None and owned[member] < cap:
            owner[lane] = member
            owned[member] += 1
            left -= 1
            if not left:
                break
    orders = []
    for lane, row in enumerate(weights):
        first = owner[lane]
        assert first is not None  # cap * members >= lanes
        ranked = [m for _, m in sorted(row, reverse=True) if m != first]
        backups = ranked[: max(depth - 1, 0)]
        orders.append((first, *backups))
    return LaneOrder(names, tuple(orders))

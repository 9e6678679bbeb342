"""The fleet-wide KV index, as one gateway keeps it: which replica's engine holds
which prefix keys (streams/kv_index.py), from the workers' deltas on
``jetserve.kvidx`` (docs/routing.md, "KV-event-aware routing").

Bounded: at most ``max_entries`` (key, replica) entries, the least recently
used key going first. A replica's entries go when it leaves the members, when a
refresh no longer lists them, or when nothing was heard from it for ``ttl_s``
(its worker died or stopped following its engine's events).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from streams.kv_index import KvIndexDelta

MAX_ENTRIES = 1 << 18
TTL_S = 15.0  # three of the workers' refreshes (workers/inference/kv_reporter.py)


class KvIndex:
    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max_entries
        self._ttl = ttl_s
        self._clock = clock
        self._holders: OrderedDict[int, set[str]] = OrderedDict()  # key -> replicas, LRU first
        self._keys_of: dict[str, set[int]] = {}
        self._heard: dict[str, float] = {}
        self.entries = 0

    @property
    def replicas(self) -> int:
        return len(self._keys_of)

    def apply(self, delta: KvIndexDelta) -> None:
        replica = delta.replica
        self._heard[replica] = self._clock()
        mine = self._keys_of.setdefault(replica, set())
        if delta.refresh:
            for key in mine - set(delta.added):
                self._unhold(key, replica)
        for key in delta.removed:
            self._unhold(key, replica)
        for key in delta.added:
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = set()
            if replica not in holders:
                holders.add(replica)
                mine.add(key)
                self.entries += 1
        while self.entries > self._max and self._holders:
            key, holders = self._holders.popitem(last=False)
            for r in holders:
                self._keys_of[r].discard(key)
            self.entries -= len(holders)
        if not mine:
            del self._keys_of[replica]

    def _unhold(self, key: int, replica: str) -> None:
        holders = self._holders.get(key)
        if holders is None or replica not in holders:
            return
        holders.discard(replica)
        self.entries -= 1
        if not holders:
            del self._holders[key]
        mine = self._keys_of.get(replica)
        if mine is not None:
            mine.discard(key)

    def drop(self, replica: str) -> None:
        for key in list(self._keys_of.pop(replica, ())):
            holders = self._holders.get(key)
            if holders is not None and replica in holders:
                holders.discard(replica)
                self.entries -= 1
                if not holders:
                    del self._holders[key]
        self._heard.pop(replica, None)

    def retain(self, members: Collection[str]) -> None:
        """Forget replicas that are no longer members, or silent past the TTL."""
        horizon = self._clock() - self._ttl
        for replica in list(self._keys_of):
            if replica not in members or self._heard.get(replica, 0.0) < horizon:
                self.drop(replica)

    def longest(self, keys: Sequence[int], live: Collection[str]) -> tuple[int, list[str]]:
        """How many leading keys of ``keys`` the best replicas hold (0: none) and
        which live replicas hold that many."""
        horizon = self._clock() - self._ttl
        for n in range(len(keys), 0, -1):
            holders = self._holders.get(keys[n - 1])
            if not holders:
                continue
            found = sorted(r for r in holders if r in live and self._heard.get(r, 0.0) >= horizon)
            if found:
                self._holders.move_to_end(keys[n - 1])
                return n, found
        return 0, []

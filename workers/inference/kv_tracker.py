"""Which prefix keys one engine holds, from its KV events (docs/routing.md,
"KV-event-aware routing").

The tracker mirrors the engine's cached blocks (hash -> parent, depth in its
chain) from BlockStored / BlockRemoved. When a request that carries prefix keys
(streams/kv_index.py) ends, the engine has said how many prompt tokens it had:
its prompt's chain is ``prompt_tokens // block_size`` full blocks long, and the
one chain of that depth whose last block was stored while the request ran is
its chain. The answer may come before the events (HTTP and ZMQ race), so a
request waits up to ``LEARN_WAIT_S`` for its chain, tried again at each batch.
None found, or several: the request is not learnt from (a prompt cached whole
stores nothing, and two requests of one length at once are ambiguous).
Key ``i`` covers ``share_i`` of the prompt text, so it needs the chain's first
``floor(share_i * length)`` blocks; it is held while all of them are cached,
and withdrawn the moment BlockRemoved evicts one. What is unknown is never
claimed: lost events (a gap in the engine's sequence numbers) drop everything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from streams.kv_index import PrefixKey
from workers.inference.kv_events import BlockHash, Cleared, Event, Removed, Stored

MAX_BLOCKS = 1 << 20  # mirrored blocks at most (an engine's cache is far smaller)
# Keys held at most, the oldest let go first: prompts with a common head and a
# varied tail each leave a key on the same few hot blocks, so they grew without
# bound (60,000 on 20 blocks), and a refresh past the bus's 1 MB never went out.
# A refresh of this many keys is ~0.7 MB.
MAX_HELD_KEYS = 1 << 15
# A request's answer can reach the worker before the engine's events about its
# prefill do (they travel apart: HTTP and ZMQ): its learning waits this long
# for them, tried again as each batch arrives.
LEARN_WAIT_S = 2.0
MAX_PENDING = 1024


class _Pending:
    __slots__ = ("cached", "keys", "length", "since", "until")

    def __init__(
        self, keys: Sequence[PrefixKey], since: int, length: int, cached: int, until: float
    ) -> None:
        self.keys, self.since, self.length, self.until = keys, since, length, until
        self.cached = cached  # prompt tokens the engine found cached


class KvTracker:
    def __init__(
        self,
        outcome: Callable[[str], None] = lambda outcome: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._outcome = outcome  # "learnt" or "unattributed", per request with keys
        self._clock = clock
        self._pending: list[_Pending] = []
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._depth: dict[BlockHash, int] = {}
        self._stored_at: dict[BlockHash, int] = {}  # the store count when it was stored
        self._by_depth: dict[int, set[BlockHash]] = {}
        self._stores = 0
        self.block_size = 0  # learnt from the first BlockStored
        self._held: dict[int, tuple[BlockHash, ...]] = {}  # key -> the blocks it needs
        self._needed_by: dict[BlockHash, set[int]] = {}
        self.added: set[int] = set()  # since the last take()
        self.removed: set[int] = set()
        self.learnt = 0
        self.unattributed = 0  # requests with keys whose chain was not found (or not one)

    # -- the engine's events -------------------------------------------------------------
    def apply(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, Stored):
                self._stored(event)
            elif isinstance(event, Removed):
                for h in event.block_hashes:
                    self._forget(h)
            elif isinstance(event, Cleared):
                self.reset()
        if self._pending:
            self._retry()

    def _stored(self, event: Stored) -> None:
        self.block_size = event.block_size
        parent = event.parent
        depth = 0 if parent is None else self._depth.get(parent, -1)
        self._stores += 1
        for h in event.block_hashes:
            if len(self._parent) >= MAX_BLOCKS:
                self.reset()  # events were lost somewhere: start over
                depth = -1
            depth = depth + 1 if depth >= 0 else -1
            self._parent[h] = parent
            self._stored_at[h] = self._stores
            if depth > 0:
                self._depth[h] = depth
                self._by_depth.setdefault(depth, set()).add(h)
            parent = h

    def _forget(self, h: BlockHash) -> None:
        self._parent.pop(h, None)
        self._stored_at.pop(h, None)
        depth = self._depth.pop(h, None)
        if depth is not None:
            level = self._by_depth.get(depth)
            if level is not None:
                level.discard(h)
                if not level:
                    del self._by_depth[depth]
        for key in self._needed_by.pop(h, ()):
            self._drop(key)

    def reset(self) -> None:
        """Forget every block and withdraw every key (cleared, or events lost)."""
        for key in list(self._held):
            self._drop(key)
        self._parent.clear()
        self._depth.clear()
        self._stored_at.clear()
        self._by_depth.clear()
        self._needed_by.clear()

    # -- requests --------------------------------------------------------------------------
    def mark(self) -> int:
        """Where the events stand as a request starts (give it to :meth:`learn`)."""
        return self._stores

    def learn(
        self, keys: Sequence[PrefixKey], since: int, prompt_tokens: int, cached_tokens: int = 0
    ) -> None:
        """A request with ``keys`` that started at ``since`` ended with a prompt
        of ``prompt_tokens`` engine tokens, ``cached_tokens`` of them found
        cached: tie its keys to its chain (now, or once the events of its
        prefill have arrived)."""
        if not keys:
            return
        until = self._clock() + LEARN_WAIT_S
        pending = _Pending(keys, since, prompt_tokens, cached_tokens, until)
        if self.block_size and self._try(pending):
            return
        if len(self._pending) >= MAX_PENDING:
            self._give_up(self._pending.pop(0))
        self._pending.append(pending)

    def _retry(self) -> None:
        now, left = self._clock(), []
        for p in self._pending:
            if self._try(p):
                continue
            if p.until <= now:
                self._give_up(p)
            else:
                left.append(p)
        self._pending = left

    def _give_up(self, _: _Pending) -> None:
        self.unattributed += 1
        self._outcome("unattributed")

    def _try(self, p: _Pending) -> bool:
        if not self.block_size:
            return False
        length = p.length // self.block_size
        ends = [h for h in self._by_depth.get(length, ()) if self._stored_at.get(h, -1) > p.since]
        chains = [c for c in (self._chain(h, length) for h in ends) if self._fits(c, p)]
        if len(chains) != 1:
            return False
        chain = chains[0]
        self.learnt += 1
        self._outcome("learnt")
        for k in p.keys:
            need = min(length, math.floor(k.share * length))
            if need < 1:
                continue
            self._hold(k.key, tuple(chain[:need]))
        return True

    def _chain(self, end: BlockHash, length: int) -> list[BlockHash]:
        """The chain from the first block to ``end`` ([] if a link is unknown)."""
        chain: list[BlockHash] = []
        h: BlockHash | None = end
        while h is not None and len(chain) < length:
            chain.append(h)
            h = self._parent.get(h)
        chain.reverse()
        return chain if len(chain) == length else []

    def _fits(self, chain: list[BlockHash], p: _Pending) -> bool:
        """Whether ``chain`` can be the request's: it starts with the blocks of
        any of its keys already held (the same text, the same blocks), and the
        blocks the engine found cached were there before the request started."""
        if not chain:
            return False
        for k in p.keys:
            held = self._held.get(k.key)
            if held is not None and tuple(chain[: len(held)]) != held:
                return False
        hits = min(p.cached // self.block_size, len(chain))
        return not hits or self._stored_at.get(chain[hits - 1], p.since + 1) <= p.since

    def expire(self) -> None:
        """Give up on requests whose events never came (called now and then)."""
        if self._pending:
            self._retry()

    def _hold(self, key: int, blocks: tuple[BlockHash, ...]) -> None:
        old = self._held.get(key)
        if old == blocks:
            return
        if old is not None:
            self._unlink(key, old)
        elif key in self.removed:
            # Dropped and learnt again before the flush: the gateways still have
            # it (the removal was never sent), so nothing to tell; dropped again,
            # it must be withdrawn (as "added", it was discarded unsaid).
            self.removed.discard(key)
        else:
            self.added.add(key)
        self._held[key] = blocks
        for b in blocks:
            self._needed_by.setdefault(b, set()).add(key)
        while len(self._held) > MAX_HELD_KEYS:
            self._drop(next(iter(self._held)))  # the oldest learnt

    def _unlink(self, key: int, blocks: tuple[BlockHash, ...]) -> None:
        for b in blocks:
            users = self._needed_by.get(b)
            if users is not None:
                users.discard(key)
                if not users:
                    del self._needed_by[b]

    def _drop(self, key: int) -> None:
        blocks = self._held.pop(key, None)
        if blocks is None:
            return
        self._unlink(key, blocks)
        if key in self.added:
            self.added.discard(key)  # never told: nothing to take back
        else:
            self.removed.add(key)

    # -- what to tell the gateways -------------------------------------------------------
    def take(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The keys added and removed since the last take."""
        added, removed = tuple(self.added), tuple(self.removed)
        self.added.clear()
        self.removed.clear()
        return added, removed

    def held(self) -> tuple[int, ...]:
        return tuple(self._held)

    @property
    def blocks(self) -> int:
        return len(self._parent)

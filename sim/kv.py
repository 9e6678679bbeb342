"""Paged KV-cache block manager with chained prefix hashes, like vLLM's v1 prefix cache.

A full block is identified by hash(parent block hash, its token ids), so a hit on block
i implies blocks 0..i-1 match too. Blocks are ref-counted; a block whose refcount drops
to 0 keeps its content (and its hash) in an LRU list and is evicted only when a new
block is needed. Usage counts only blocks with refcount > 0, so it is 0 when idle.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from sim.kv_events import KvEventSink

ROOT_HASH = 0x6A09E667F3BCC908  # parent of the first block of every sequence


def salted_root(salt: str) -> int:
    """The first block's parent: the same for every unsalted sequence; one per salt
    (vLLM mixes ``cache_salt`` into the first block's hash)."""
    if not salt:
        return ROOT_HASH
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return hash((ROOT_HASH, int.from_bytes(digest, "big")))


def chain_hashes(
    token_ids: Sequence[int], block_size: int, hashes: list[int], root: int = ROOT_HASH
) -> list[int]:
    """Extend `hashes` (chained hashes of full blocks) to cover every full block."""
    full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), full):
        # Tuple hashing of ints is not randomised per process: stable across runs.
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, events: KvEventSink | None = None) -> None:
        self.num_blocks = num_blocks
        # vLLM's KV events (sim/kv_events.py): a block cached, a block evicted.
        self.events = events
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # never cached (or dropped) blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached, LRU first
        self._used = 0

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def available(self) -> int:
        return len(self._free) + len(self._evictable)

    def usage(self) -> float:
        return self._used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, full_hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of `full_hashes` are cached (at most `max_blocks`)."""
        n = 0
        for h in full_hashes[:max_blocks]:
            if h not in self._cached:
                break
            n += 1
        return n

    def allocate(
        self,
        full_hashes: Sequence[int],
        num_blocks: int,
        max_cached_blocks: int,
        token_ids: Sequence[int] = (),
    ) -> tuple[list[int], int] | None:
        """Blocks for the first `num_blocks` blocks of a sequence whose leading full
        blocks have `full_hashes` (those being computed now: they become cacheable).
        Reuses the longest cached prefix (at most `max_cached_blocks`). Returns (block
        ids, number of cached blocks reused), or None if it does not fit.
        """
        hits: list[int] = []
        for h in full_hashes[:max_cached_blocks]:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        need = num_blocks - len(hits)
        # Hit blocks sitting in the LRU list stop being evictable once taken.
        idle_hits = sum(1 for b in hits if self._ref[b] == 0)
        if need > self.available - idle_hits:
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
                self._used += 1
            self._ref[b] += 1
        blocks = hits + [self._take_free() for _ in range(need)]
        # Newly computed full blocks become cacheable right away (vLLM caches at schedule).
        for i in range(len(hits), min(len(full_hashes), num_blocks)):
            parent = full_hashes[i - 1] if i else None
            self.register(blocks[i], full_hashes[i], parent, self._tokens(token_ids, i))
        return blocks, len(hits)

    def append(self) -> int | None:
        """One more block for a growing sequence, or None when the cache is full."""
        if not self.available:
            return None
        return self._take_free()

    def _tokens(self, token_ids: Sequence[int], i: int) -> Sequence[int]:
        return token_ids[i * self.block_size : (i + 1) * self.block_size]

    def register(
        self,
        block: int,
        block_hash: int,
        parent: int | None = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Mark a full block's content as reusable by later prefixes (``parent``:
        the previous block's hash, None for a first block; with ``token_ids``,
        the block's, for its BlockStored event)."""
        if block_hash in self._cached or self._hash[block] is not None:
            return  # a duplicate of a block computed concurrently: leave it uncached
        self._cached[block_hash] = block
        self._hash[block] = block_hash
        if self.events is not None:
            self.events.stored(block_hash, parent, token_ids, self.block_size)

    def free(self, blocks: Sequence[int]) -> None:
        # Reverse order: a sequence's tail blocks become the first eviction candidates.
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] > 0:
                continue
            self._used -= 1
            if self._hash[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _take_free(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)  # evict the least recently used
            h = self._hash[b]
            if h is not None:
                del self._cached[h]
                if self.events is not None:
                    self.events.removed(h)
            self._hash[b] = None
        self._ref[b] = 1
        self._used += 1
        return b

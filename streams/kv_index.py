"""The fleet-wide KV index on the bus: what a replica's engine holds, in keys a
gateway can compute without a tokenizer (docs/routing.md, "KV-event-aware routing").

- A **prefix key** names a prefix of a request's routing text (the text the
  gateway's lane hash reads, ``gateway/inference/lanes.py``): a chain of hashes
  over fixed chunks, so key ``i`` stands for the first ``i + 1`` chunks and a
  request shares key ``i`` with another exactly when their texts agree that far.
  The tenant is hashed in unless the route shares the prefix across tenants.
- A request carries its keys (:class:`PrefixKey`, with the share of the prompt
  text each covers) to the worker, which ties each key to the engine's KV blocks
  the request's prefill stored (vLLM KV events) and publishes
  :class:`KvIndexDelta` on :data:`KV_INDEX_SUBJECT` (core NATS) as the engine
  stores and evicts them.
- Gateways keep the deltas in memory and route a request to the replica that
  holds its longest key (``gateway/inference/kv_index.py``).
"""

from __future__ import annotations

import hashlib

import msgspec

from streams.subjects import KV_INDEX_SUBJECT

__all__ = ["KV_INDEX_SUBJECT", "KvIndexDelta", "PrefixKey", "prefix_keys"]
CHUNK_CHARS = 256  # the routing text is keyed in chunks this long (the last may be shorter)
MAX_KEYS = 64  # keys per request at most (prefix_chars / CHUNK_CHARS is 8 by default)


class PrefixKey(msgspec.Struct, frozen=True, array_like=True):
    """One prefix key of a request and the share (0..1] of its prompt text, in
    characters, that ends where the key's chunk ends (the worker turns it into
    a count of engine blocks)."""

    key: int
    share: float


class KvIndexDelta(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A replica's change: keys its engine now holds (``added``), keys it no
    longer holds (``removed``). ``refresh``: ``added`` is everything it holds, and
    what a gateway had for it besides is gone (sent periodically, so a gateway
    that started late, or missed a delta, catches up)."""

    replica: str
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    refresh: bool = False


_delta_decoder = msgspec.json.Decoder(KvIndexDelta)


def encode_delta(delta: KvIndexDelta) -> bytes:
    return msgspec.json.encode(delta)


def decode_delta(data: bytes) -> KvIndexDelta:
    return _delta_decoder.decode(data)


def prefix_keys(scope: str, text: str, total_chars: int) -> list[PrefixKey]:
    """The chained keys of ``text`` (``scope``: the tenant, or "" for a prefix
    shared across tenants), one per chunk of :data:`CHUNK_CHARS`; each with the
    share of a prompt of ``total_chars`` characters it covers."""
    keys: list[PrefixKey] = []
    digest = hashlib.blake2b(scope.encode(), digest_size=8).digest()
    total = max(total_chars, len(text), 1)
    for end in range(CHUNK_CHARS, len(text) + CHUNK_CHARS, CHUNK_CHARS):
        chunk = text[end - CHUNK_CHARS : end]
        digest = hashlib.blake2b(digest + chunk.encode(), digest_size=8).digest()
        keys.append(PrefixKey(int.from_bytes(digest, "big"), min(end, len(text)) / total))
        if len(keys) == MAX_KEYS:
            break
    return keys

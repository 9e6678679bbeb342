"""vLLM's KV cache events, read off the engine's ZMQ PUB socket (``--kv-events-config``).

The wire shape is vLLM's (``vllm/distributed/kv_events.py``): multipart
``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)``. vLLM v0.9 to v0.11
(and the simulator, sim/kv_events.py) encode the batch and its events as
tagged arrays (``["BlockStored", hashes, parent, token_ids, block_size, ...]``);
later versions encode them as maps (``{"type": "BlockStored", ...}``) and make
block hashes bytes. Both are read here, into one shape: :class:`Stored`,
:class:`Removed`, :class:`Cleared`. Fields a version adds are ignored, and so are
events about copies offloaded off the GPU (``medium`` other than ``"GPU"``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec

log = logging.getLogger(__name__)

BlockHash = int | bytes


class Stored(msgspec.Struct, frozen=True):
    block_hashes: list[BlockHash]
    parent: BlockHash | None
    block_size: int


class Removed(msgspec.Struct, frozen=True):
    block_hashes: list[BlockHash]


class Cleared(msgspec.Struct, frozen=True):
    pass


Event = Stored | Removed | Cleared


# -- vLLM's array-like shape (v0.9 .. v0.11) -------------------------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, frozen=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored", frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved", frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared", frozen=True):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]


# -- vLLM's map shape (later versions) -------------------------------------------------
class _MapEvent(msgspec.Struct, tag=True, frozen=True):
    pass


class _MapStored(_MapEvent, tag="BlockStored", frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    block_size: int
    medium: str | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved", frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared", frozen=True):
    pass


class _MapBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]


_GPU = (None, "GPU")  # the medium of the engine's own cache (None: before vLLM named it)
_array = msgspec.msgpack.Decoder(_ArrayBatch)
_map = msgspec.msgpack.Decoder(_MapBatch)


def decode_batch(payload: bytes) -> list[Event]:
    """One KVEventBatch's events, in order (``msgspec.DecodeError``: neither shape)."""
    batch: _ArrayBatch | _MapBatch
    try:
        batch = _array.decode(payload)
    except msgspec.DecodeError:
        batch = _map.decode(payload)
    out: list[Event] = []
    for e in batch.events:
        if not isinstance(e, _ArrayCleared | _MapCleared) and e.medium not in _GPU:
            continue  # an offloaded copy (CPU, disk): not what the engine's GPU holds
        if isinstance(e, _ArrayStored | _MapStored):
            out.append(Stored(e.block_hashes, e.parent_block_hash, e.block_size))
        elif isinstance(e, _ArrayRemoved | _MapRemoved):
            out.append(Removed(e.block_hashes))
        else:
            out.append(Cleared())
    return out


class KvEventFeed:
    """Subscribes to one engine's KV events and hands each batch to ``apply``;
    ``gap`` is told when batches were lost (a sequence number skipped, an
    undecodable batch): what the events said since is unknown."""

    def __init__(
        self,
        endpoint: str,
        apply: Callable[[list[Event]], None],
        gap: Callable[[], None],
        topic: str = "",
    ) -> None:
        self.endpoint = endpoint
        self._apply = apply
        self._gap = gap
        self._topic = topic.encode()
        self.batches = 0
        self.gaps = 0

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        sock: Any = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.connect(self.endpoint)
        last: int | None = None
        try:
            while True:
                parts = await sock.recv_multipart()
                if len(parts) != 3:
                    continue  # not a KV event batch
                _, seq_b, payload = parts
                seq = int.from_bytes(seq_b, "big", signed=True)
                if last is not None and seq != last + 1:
                    self._lost()
                last = seq
                try:
                    events = decode_batch(payload)
                except msgspec.DecodeError as exc:
                    log.warning("undecodable KV event batch from %s: %s", self.endpoint, exc)
                    self._lost()
                    continue
                self.batches += 1
                self._apply(events)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=0)

    def _lost(self) -> None:
        self.gaps += 1
        self._gap()

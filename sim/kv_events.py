"""KV cache events, as vLLM publishes them (``--kv-events-config``).

vLLM's wire shape (``vllm/distributed/kv_events.py``, v0.9 to v0.11, the one
llm-d's indexer decodes): a ZMQ PUB multipart message ``(topic, seq as 8 bytes
big-endian, payload)``, the payload a msgpack ``KVEventBatch(ts, events,
data_parallel_rank)`` of array-like tagged structs:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

The simulator's block hashes are its own chained hashes (sim/kv.py), signed
64-bit ints as vLLM's builtin hash gave. Events are collected as blocks become
cached (at schedule, as vLLM caches) or are evicted, and sent once per
scheduling step, as vLLM's engine core does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import msgspec

log = logging.getLogger("sim.kv_events")

MEDIUM_GPU = "GPU"


class KVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True, frozen=True
):
    """A KV cache event (the base of vLLM's tagged union)."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``endpoint``'s port plus ``offset`` (vLLM's rule for data-parallel ranks,
    which replica ``i`` of ``jetserve sim --replicas N`` follows)."""
    if not offset:
        return endpoint
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + offset}"
    return f"{endpoint}_{offset}"  # ipc:// or inproc://: a name of its own


class KvEventSink:
    """Collects one step's events; ``flush`` sends them as one batch."""

    def __init__(self, publisher: ZmqPublisher | None = None) -> None:
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._removed: list[int] = []
        self._publisher = publisher

    def stored(
        self, block_hash: int, parent: int | None, token_ids: Sequence[int], block_size: int
    ) -> None:
        last = self._events[-1] if self._events else None
        # A run of blocks of one sequence is one event, as vLLM sends it.
        if isinstance(last, BlockStored) and not self._removed and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self._close_removed()
        self._events.append(BlockStored([block_hash], parent, list(token_ids), block_size))

    def removed(self, block_hash: int) -> None:
        self._removed.append(block_hash)

    def cleared(self) -> None:
        self._close_removed()
        self._events.append(AllBlocksCleared())

    def _close_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed))
            self._removed = []

    def take(self) -> KVEventBatch | None:
        self._close_removed()
        if not self._events:
            return None
        batch = KVEventBatch(time.time(), self._events)
        self._events = []
        return batch

    def flush(self) -> None:
        batch = self.take()
        if batch is not None and self._publisher is not None:
            self._publisher.publish(batch)


class ZmqPublisher:
    """A ZMQ PUB socket bound to ``endpoint`` (``tcp://*:5557``), as vLLM's
    ``ZmqEventPublisher`` (without its replay socket). Sends never block: past
    the high-water mark ZMQ drops, and a subscriber sees the gap in ``seq``."""

    def __init__(self, endpoint: str, topic: str = "kv-events", hwm: int = 100_000) -> None:
        import zmq  # the only zmq user of the simulator: opt-in

        self._zmq = zmq
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        # The bound address (``tcp://127.0.0.1:*`` binds a free port).
        self.endpoint: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._topic = topic.encode()
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self.dropped = 0

    def publish(self, batch: KVEventBatch) -> None:
        payload = self._encoder.encode(batch)
        try:
            self._sock.send_multipart(
                (self._topic, self._seq.to_bytes(8, "big"), payload), flags=self._zmq.NOBLOCK
            )
        except self._zmq.Again:
            self.dropped += 1  # at the high-water mark: the seq gap tells the subscriber
        self._seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)

"""Two small KV buckets that carry what a request's messages cannot.

- **Cancel marks** (``jetserve_cancels``). A cancel is a core NATS publish on
  ``jetserve.cancel.<id>``: only a worker already subscribed hears it. So the
  canceller publishes, stores the mark, then publishes again; a worker
  subscribes to all cancels first and reads the stored marks second
  (workers/inference/cancels.py). Whatever the interleaving, it hears a publish
  or reads the mark: a cancel sent before the worker was ready still counts.
- **Failure counts** (``jetserve_failures``). JetStream counts deliveries, and a
  delivery handed back unstarted (a full worker, a drain) is not a failed
  attempt. Workers count the attempts that really failed here, and decide
  retry or dead letter on that count, not on ``num_delivered``.

Both are memory buckets whose entries expire with the work queue's ``max_age``;
both are best effort: with the bus in trouble a mark is not read (the deadline
still ends the work) and a count falls back to the delivery count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from streams.definitions import Topology
from streams.ids import is_safe_id

log = logging.getLogger(__name__)

CANCELS_BUCKET = "jetserve_cancels"
FAILURES_BUCKET = "jetserve_failures"
MARK_TIMEOUT_S = 1.0  # a sick bus delays a cancel's second publish at most this long
_BUS_ERRORS = (nats.errors.Error, TimeoutError)


def bucket_config(bucket: str, topo: Topology) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=bucket,
        history=1,
        ttl=topo.limits.max_age_s,  # a request never waits in the queue longer
        storage=StorageType.MEMORY,
        replicas=topo.replicas,
        max_value_size=1024,
        # Reads go to the leader: a mark stored before a publish is seen after it.
        direct=False,
    )


class _Bucket:
    def __init__(self, js: JetStreamContext, bucket: str, topo: Topology) -> None:
        self._js = js
        self._config = bucket_config(bucket, topo)
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> KeyValue:
        """Bind the bucket, creating it if nobody has yet (any role that uses it may)."""
        if self._kv is not None:
            return self._kv
        async with self._lock:
            if self._kv is None:
                try:
                    self._kv = await self._js.key_value(self._config.bucket)
                except BucketNotFoundError:
                    self._kv = await self._js.create_key_value(self._config)
            return self._kv


class CancelMarks(_Bucket):
    def __init__(self, js: JetStreamContext, topo: Topology) -> None:
        super().__init__(js, CANCELS_BUCKET, topo)

    async def mark(self, request_id: str, note: bytes) -> bool:
        """Store the cancel note; False (logged) when it could not be stored."""
        if not is_safe_id(request_id):
            return False
        try:
            async with asyncio.timeout(MARK_TIMEOUT_S):
                kv = await self.open()
                await kv.put(request_id, note)
        except _BUS_ERRORS as exc:
            log.warning("cancel mark for %s not stored: %r", request_id, exc)
            return False
        return True


class FailureCounts(_Bucket):
    def __init__(self, js: JetStreamContext, topo: Topology) -> None:
        super().__init__(js, FAILURES_BUCKET, topo)

    async def add(self, request_id: str) -> int | None:
        """Count one more failed attempt; the new count, or None when it could not
        be counted (the caller falls back to the delivery count)."""
        if not is_safe_id(request_id):
            return None
        try:
            kv = await self.open()
            for _ in range(10):  # compare-and-set: hedged copies may fail at once
                with contextlib.suppress(KeyWrongLastSequenceError):
                    try:
                        entry = await kv.get(request_id)
                    except KeyNotFoundError:
                        await kv.create(request_id, b"1")
                        return 1
                    count = int(entry.value or b"0") + 1
                    await kv.update(request_id, str(count).encode(), last=entry.revision)
                    return count
        except (*_BUS_ERRORS, ValueError) as exc:
            log.warning("failure of %s not counted: %r", request_id, exc)
        return None

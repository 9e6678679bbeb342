"""Fleet-wide leases in a NATS KV bucket: one holder at a time for a job that
one process of many must do (the rollout guard: gateway/admin/rollout_guard.py).

A lease is a key whose value names its owner and the time it runs until. The
holder renews it by compare-and-set on the revision it wrote; anyone may take
it once it has run out (also compare-and-set, so two takers cannot both win).
A holder that stalls past its ``until`` loses it at its next renewal. Clocks
count: the ttl must be well above the skew between hosts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.errors import KeyWrongLastSequenceError as Taken
from nats.js.kv import KeyValue

from streams.provision import ensure_bucket

LEASES_BUCKET = "jetserve_leases"


class LeaseValue(msgspec.Struct, frozen=True, kw_only=True):
    owner: str
    until: float  # unix seconds; past it anyone may take the lease


_decoder = msgspec.json.Decoder(LeaseValue)


def leases_config(replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=LEASES_BUCKET,
        description="jetserve fleet-wide leases (one holder per key)",
        history=1,
        max_value_size=1024,
        storage=StorageType.FILE,
        replicas=replicas,
    )


async def ensure_leases(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """Bind the leases bucket, creating it if absent (concurrent-safe)."""
    return await ensure_bucket(js, leases_config(replicas))


class KvLease:
    """``owner``'s claim on ``key``. NATS failures propagate to the caller."""

    def __init__(
        self,
        kv: KeyValue,
        key: str,
        owner: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kv = kv
        self.key = key
        self.owner = owner
        self.ttl_s = ttl_s
        self._clock = clock
        self._revision: int | None = None  # of the value we wrote last; None: not held

    @property
    def held(self) -> bool:
        return self._revision is not None

    async def hold(self) -> bool:
        """Renew the lease if held, else take it if free or run out; whether we hold it."""
        value = msgspec.json.encode(LeaseValue(owner=self.owner, until=self._clock() + self.ttl_s))
        if self._revision is not None:
            try:
                self._revision = await self.kv.update(self.key, value, last=self._revision)
                return True
            except Taken:
                self._revision = None  # run out, and someone took it over
        try:
            self._revision = await self.kv.create(self.key, value)
            return True
        except Taken:
            pass
        try:
            entry = await self.kv.get(self.key)
        except (KeyNotFoundError, KeyDeletedError):
            return False  # released between our create and get: next time
        held = _decoder.decode(entry.value or b"")
        if held.until > self._clock() and held.owner != self.owner:
            return False
        # Run out (or ours from before a restart): only if nobody took it meanwhile.
        try:
            self._revision = await self.kv.update(self.key, value, last=entry.revision)
        except Taken:
            return False
        return True

    async def release(self) -> None:
        """Give it back (only if still ours); it runs out anyway."""
        if self._revision is None:
            return
        revision, self._revision = self._revision, None
        with contextlib.suppress(nats.errors.Error, TimeoutError, Taken):
            await self.kv.delete(self.key, last=revision)

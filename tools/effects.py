"""The effect ledger: at most one effect per idempotency key, durably.

Layout: one JetStream KV bucket (default ``JETSERVE_EFFECTS``, file storage,
history 1, a TTL long enough to outlive any redelivery). KV key
``fx.<sha256(idempotency key) hex>`` (keys hashed so that any run or call id is a
legal KV token); value: an :class:`~tools.wire.EffectEntry` as JSON.

Protocol (driven by ``tools.dispatcher``):

1. ``record_intent`` creates the entry (``kv.create``: create-only, so of two
   concurrent callers exactly one wins; the other gets the existing entry). The
   entry holds a lease: "I am running it until ``lease_until``".
2. The winner runs the effect, passing the key to the tool.
3. ``record_outcome`` settles it (``kv.update`` with the revision it holds).
   The first outcome wins forever; later calls with the key return it.

A key found in state ``intent`` after its lease ran out means the caller died
between 1 and 3 (or gave up): the effect may have happened. Then the tool's
``reconcile(key)`` decides (``record_outcome`` of its answer, or ``take_over``
and run), and without one the call is ``ambiguous`` until ``resolve``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from tools.errors import EffectLedgerError
from tools.wire import EffectEntry, Outcome, decode_entry, encode

Clock = Callable[[], float]


@dataclass(frozen=True)
class EffectLedgerConfig:
    bucket: str = "JETSERVE_EFFECTS"
    history: int = 1
    ttl_s: float = 30 * 86400.0  # outcomes must outlive any redelivery of their step
    replicas: int = 1
    max_value_size: int = 1 << 20

    def kv_config(self) -> KeyValueConfig:
        return KeyValueConfig(
            bucket=self.bucket,
            description="jetserve effect ledger: tool call intents and outcomes",
            history=self.history,
            ttl=self.ttl_s,
            replicas=self.replicas,
            max_value_size=self.max_value_size,
            storage=StorageType.FILE,
        )


def kv_key(key: str) -> str:
    """The KV key of an idempotency key."""
    return "fx." + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Effect:
    """An entry as read or written, with its KV revision. ``won``: this call's
    own write took effect (it created, settled or took over the entry)."""

    entry: EffectEntry
    revision: int
    won: bool


class EffectLedger:
    def __init__(self, kv: KeyValue, clock: Clock = time.time) -> None:
        self.kv = kv
        self._clock = clock

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        config: EffectLedgerConfig | None = None,
        clock: Clock = time.time,
    ) -> EffectLedger:
        """Bind to the bucket, creating it if absent (idempotent, race-safe)."""
        config = config or EffectLedgerConfig()
        try:
            kv = await js.key_value(config.bucket)
        except BucketNotFoundError:
            try:
                kv = await js.create_key_value(config.kv_config())
            except NatsError as exc:  # a concurrent creator may have won
                try:
                    kv = await js.key_value(config.bucket)
                except BucketNotFoundError:
                    raise EffectLedgerError(f"cannot create bucket {config.bucket}: {exc}") from exc
        except NatsError as exc:
            raise EffectLedgerError(f"cannot open bucket {config.bucket}: {exc}") from exc
        return cls(kv, clock)

    # -- reads ---------------------------------------------------------------

    async def get(self, key: str) -> Effect | None:
        try:
            e = await self.kv.get(kv_key(key))
        except KeyNotFoundError:  # also a deleted (withdrawn) key
            return None
        except NatsError as exc:
            raise EffectLedgerError(f"effect ledger read failed: {exc}") from exc
        assert e.value is not None
        assert e.revision is not None
        return Effect(decode_entry(e.value), e.revision, won=False)

    async def status(self, key: str) -> EffectEntry | None:
        """The ledger's answer for ``key``: ``None`` (never attempted, or withdrawn),
        ``state == "intent"`` (running, or unknown if its lease expired), or
        ``state == "done"`` with the first outcome."""
        eff = await self.get(key)
        return eff.entry if eff else None

    async def pending(self) -> list[EffectEntry]:
        """Entries without an outcome (running or awaiting reconciliation)."""
        try:
            keys = await self.kv.keys()
        except NatsError:  # NoKeysError and friends: nothing to list
            return []
        out = []
        for k in keys:
            try:
                e = await self.kv.get(k)
            except KeyNotFoundError:
                continue
            if e.value:
                entry = decode_entry(e.value)
                if entry.state == "intent":
                    out.append(entry)
        return out

    # -- writes --------------------------------------------------------------

    async def record_intent(self, key: str, tool: str, args_hash: str, *, lease_s: float) -> Effect:
        """Create the intent (create-only). If the key exists, return the existing
        entry with ``won=False``."""
        now = self._clock()
        entry = EffectEntry(
            key=key,
            tool=tool,
            args_hash=args_hash,
            state="intent",
            intent_at=now,
            lease_until=now + lease_s,
        )
        for _ in range(3):
            try:
                rev = await self.kv.create(kv_key(key), encode(entry))
                return Effect(entry, rev, won=True)
            except KeyWrongLastSequenceError:
                have = await self.get(key)
                if have is not None:
                    return have
                # withdrawn between our create and get: try again
            except NatsError as exc:
                raise EffectLedgerError(f"effect ledger write failed: {exc}") from exc
        raise EffectLedgerError(f"effect ledger: cannot create or read {kv_key(key)}")

    async def record_outcome(
        self, key: str, outcome: Outcome, revision: int, *, settled_by: str = "run"
    ) -> Effect:
        """Settle the intent held at ``revision``. If someone else wrote first,
        nothing is written and the current entry comes back with ``won=False``
        (first outcome wins)."""
        have = await self.get(key)
        if have is None:
            raise EffectLedgerError(f"effect ledger: no intent for {kv_key(key)}")
        if have.revision != revision or have.entry.state == "done":
            return have
        entry = msgspec.structs.replace(
            have.entry, state="done", outcome=outcome, done_at=self._clock(), settled_by=settled_by
        )
        return await self._swap(key, entry, revision)

    async def take_over(self, key: str, revision: int, *, lease_s: float) -> Effect:
        """Claim an intent whose lease expired (its owner is gone), to run the
        effect again: only once reconcile said it did not happen."""
        have = await self.get(key)
        if have is None or have.revision != revision or have.entry.state == "done":
            if have is None:
                raise EffectLedgerError(f"effect ledger: no intent for {kv_key(key)}")
            return have
        now = self._clock()
        entry = msgspec.structs.replace(
            have.entry, attempt=have.entry.attempt + 1, intent_at=now, lease_until=now + lease_s
        )
        return await self._swap(key, entry, revision)

    async def withdraw(self, key: str, revision: int) -> bool:
        """Remove an intent whose effect certainly did not happen (the call was
        never delivered), so the key can run later. False if it changed meanwhile."""
        try:
            await self.kv.delete(kv_key(key), last=revision)
        except NatsError:
            return False
        return True

    async def resolve(self, key: str, outcome: Outcome) -> Effect:
        """Operator: settle an ``ambiguous`` key with what really happened. The
        first outcome still wins: a settled key is returned unchanged."""
        for _ in range(5):
            have = await self.get(key)
            if have is None:
                raise EffectLedgerError(f"effect ledger: no intent for {kv_key(key)}")
            if have.entry.state == "done":
                return have
            eff = await self.record_outcome(key, outcome, have.revision, settled_by="resolved")
            if eff.won:
                return eff
        raise EffectLedgerError(f"effect ledger: {kv_key(key)} keeps changing")

    async def _swap(self, key: str, entry: EffectEntry, revision: int) -> Effect:
        try:
            rev = await self.kv.update(kv_key(key), encode(entry), last=revision)
        except KeyWrongLastSequenceError:
            now = await self.get(key)
            if now is None:
                raise EffectLedgerError(f"effect ledger: {kv_key(key)} vanished") from None
            return now
        except NatsError as exc:
            raise EffectLedgerError(f"effect ledger write failed: {exc}") from exc
        return Effect(entry, rev, won=True)

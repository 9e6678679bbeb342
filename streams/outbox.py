"""The settlement outbox: a request's charge and ledger record, made durable in
JetStream before either store is touched.

A gateway that ends a request publishes its :class:`Settlement` on
``jetserve.outbox.<gateway>`` (stream ``JETSERVE_OUTBOX``, file storage), then
applies it (the budget hold reconciled in Redis, the record appended to the
ledger) and deletes it. What it could not apply (Redis frozen, the ledger's
leader moving, the gateway killed) stays in the stream, and every gateway's
scanner applies what has been there longer than a grace period. Applying is
idempotent by request id and writer (gateway/tenancy/accounting_lua.py, and the
ledger's ``Nats-Msg-Id``), so a settlement applied twice charges once and
records once (gateway/inference/settlements.py).

Under load a gateway stores the settlements that wait for one store as one
:class:`SettlementBatch` message (group commit): one publish and one delete per
batch, not per request (docs/scale.md, "settlement batched").
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NotFoundError

from streams.headers import Header
from streams.ids import is_safe_id
from streams.provision import ensure_stream
from streams.removal import remove_msg
from streams.request_ledger import LedgerRecord
from streams.subjects import PREFIX

DAY_S = 86_400.0


class Settlement(msgspec.Struct, frozen=True, tag="settle", kw_only=True):
    """One request's books. ``actual_micros`` None: a record only (a refusal
    before any hold); else the hold of ``record.request_id`` becomes this charge
    (0 releases it). The record's ``charge_micros`` is filled in when applied:
    it is what Redis charged. ``writer`` tells settlements of one request apart
    (the gateway that finished it, a resuming replica, the orphan sweep)."""

    record: LedgerRecord
    writer: str
    actual_micros: int | None = None


class SettlementBatch(msgspec.Struct, frozen=True, tag="settle_batch", kw_only=True):
    """Settlements stored together; each is applied on its own (idempotently),
    and the message is deleted once all of them are."""

    settlements: list[Settlement]


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Settlement | SettlementBatch)


def encode_settlement(s: Settlement | SettlementBatch) -> bytes:
    return _enc.encode(s)


def decode_settlements(data: bytes) -> list[Settlement]:
    """The settlements of one outbox message (one, or a batch's)."""
    found = _dec.decode(data)
    return found.settlements if isinstance(found, SettlementBatch) else [found]


@dataclass(frozen=True)
class OutboxTopology:
    stream: str = "JETSERVE_OUTBOX"
    replicas: int = 1
    subject_prefix: str = f"{PREFIX}.outbox"
    # Long enough to outlast any Redis or ledger outage an operator would let
    # run; a settlement still here after it is evidence of a bug, kept a week.
    max_age_s: float = 7 * DAY_S
    max_msg_size: int = 64 << 10  # a record is ~0.5 KiB
    # A republished settlement (our publish's ack lost) is stored once.
    duplicate_window_s: float = 600.0

    def subject(self, gateway: str) -> str:
        if not is_safe_id(gateway):
            raise ValueError(f"invalid gateway id for the outbox: {gateway!r}")
        return f"{self.subject_prefix}.{gateway}"

    def stream_config(self) -> StreamConfig:
        return StreamConfig(
            name=self.stream,
            subjects=[f"{self.subject_prefix}.*"],
            retention=RetentionPolicy.LIMITS,
            # Never drop a settlement to make room: refuse new ones instead.
            discard=DiscardPolicy.NEW,
            storage=StorageType.FILE,
            max_age=self.max_age_s,
            max_msg_size=self.max_msg_size,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
        )


DEFAULT_OUTBOX = OutboxTopology()


async def ensure_outbox(js: JetStreamContext, topo: OutboxTopology = DEFAULT_OUTBOX) -> None:
    await ensure_stream(js, topo.stream_config())


@dataclass(frozen=True)
class Pending:
    """A settlement still in the outbox: its sequence and age by the server's clock."""

    seq: int
    settlements: list[Settlement] | None  # None: undecodable (dead-lettered by the caller)
    data: bytes
    subject: str
    stored_at: float


class Outbox:
    def __init__(self, js: JetStreamContext, topo: OutboxTopology = DEFAULT_OUTBOX) -> None:
        self._js = js
        self.topo = topo

    async def publish(self, gateway: str, s: Settlement, timeout_s: float = 2.0) -> int:
        """Store ``s``; its stream sequence. Raises the bus's errors."""
        msg_id = f"{s.record.tenant}:{s.record.request_id}:{s.writer}"
        return await self._store(gateway, encode_settlement(s), msg_id, timeout_s)

    async def publish_batch(
        self, gateway: str, batch: SettlementBatch, msg_id: str, timeout_s: float = 2.0
    ) -> int | None:
        """Store ``batch`` as one message; its sequence, or None when it is too
        big for one (nothing stored). ``msg_id`` makes a republish (our ack
        lost) a duplicate. Raises the bus's errors."""
        data = encode_settlement(batch)
        if len(data) > self.topo.max_msg_size:
            return None
        return await self._store(gateway, data, msg_id, timeout_s)

    async def _store(self, gateway: str, data: bytes, msg_id: str, timeout_s: float) -> int:
        ack = await self._js.publish(
            self.topo.subject(gateway),
            data,
            timeout=timeout_s,
            stream=self.topo.stream,
            headers={Header.MSG_ID.value: msg_id},
        )
        return int(ack.seq)

    async def delete(self, seq: int) -> None:
        """Done with it; already gone (another scanner applied it) is fine."""
        with contextlib.suppress(NotFoundError):
            try:
                await remove_msg(self._js, self.topo.stream, seq)
            except APIError as exc:
                if exc.err_code != 10057:  # no message found
                    raise

    async def count(self) -> int:
        info = await self._js.stream_info(self.topo.stream)
        return int(info.state.messages)

    async def pending(self, limit: int = 256) -> AsyncIterator[Pending]:
        """The settlements in the outbox now, oldest first (at most ``limit``)."""
        if await self.count() == 0:
            return
        name = f"outbox-scan-{secrets.token_hex(6)}"
        config = ConsumerConfig(
            name=name,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
        )
        info = await self._js.add_consumer(self.topo.stream, config)
        try:
            left = min(info.num_pending or 0, limit)
            if left == 0:
                return
            sub = await self._js.pull_subscribe_bind(name, stream=self.topo.stream)
            try:
                while left > 0:
                    try:
                        msgs = await sub.fetch(min(left, 64), timeout=2.0)
                    except TimeoutError:
                        return  # deleted under us by another scanner
                    for msg in msgs:
                        meta = msg.metadata
                        left = 0 if meta.num_pending == 0 else left - 1
                        try:
                            s: list[Settlement] | None = decode_settlements(msg.data)
                        except msgspec.DecodeError:
                            s = None
                        stored_at = meta.timestamp.timestamp()
                        yield Pending(meta.sequence.stream, s, msg.data, msg.subject, stored_at)
            finally:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await sub.unsubscribe()
        finally:
            with contextlib.suppress(nats.errors.Error, TimeoutError, APIError):
                await self._js.delete_consumer(self.topo.stream, name)

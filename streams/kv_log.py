"""Reads of a KV bucket that see every acknowledged write: by subject and by
sequence, through the bucket's stream, answered by its leader.

nats-py's watch-based reads (``KeyValue.history()``, ``keys()``, the initial
values of ``watchall()``) end "the initial values" when consumer info reports
nothing pending and the client has received nothing yet. The consumer may
already have sent every message while its info reply overtakes them on the way
to the client (the server sends the two from different queues); the watch then
ends before its first value, and ``history()`` of a key with messages says
``NoKeysError``. Under load it does, a few times in a hundred. Direct gets
(``allow_direct``) may be answered by any replica, which can lag.

So here nothing ends at a marker or a timeout: every read is a message get on
the stream leader (``$JS.API.STREAM.MSG.GET``, never ``DIRECT.GET``), and a 404
is the leader saying that no such message is stored. A key's history is read
from its first message to the last one the leader holds for its subject;
the key listing is the leader's subject list from stream info.
"""

from __future__ import annotations

from datetime import datetime

import msgspec
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue


class KvMessage(msgspec.Struct, frozen=True):
    """One stored message of a key: a value, or a delete or purge marker."""

    key: str
    seq: int  # the KV revision: the message's stream sequence
    value: bytes
    operation: str | None  # None for a value; KV_DEL or KV_PURGE for a marker
    headers: dict[str, str]
    at: float  # when the server stored it (unix seconds; 0 if unknown)

    @property
    def deleted(self) -> bool:
        return self.operation in (KV_DEL, KV_PURGE)


class KvLog:
    """Leader reads of one bucket's stream ``KV_<bucket>``."""

    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self.js = js
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."

    @classmethod
    def of(cls, kv: KeyValue) -> KvLog:
        # nats-py keeps the context and the bucket name private on KeyValue.
        return cls(kv._js, kv._name)

    def subject(self, key: str) -> str:
        return f"{self.prefix}{key}"

    async def last(self, key: str) -> KvMessage | None:
        """The newest message of ``key`` (a marker included); None: the leader
        holds no message for it."""
        try:
            raw = await self.js.get_msg(self.stream, subject=self.subject(key), direct=False)
        except NotFoundError:
            return None
        return self._message(key, raw)

    async def history(self, key: str) -> list[KvMessage]:
        """Every message the stream keeps for ``key``, oldest first, up to the
        newest one the leader held when the read began; [] only when it held none."""
        head = await self.last(key)
        if head is None:
            return []
        out: list[KvMessage] = []
        seq = 1
        while seq < head.seq:
            try:
                raw = await self.js.get_msg(
                    self.stream, seq=seq, subject=self.subject(key), next=True, direct=False
                )
            except NotFoundError:  # purged meanwhile: nothing more after seq
                break
            msg = self._message(key, raw)
            if msg.seq >= head.seq:  # head itself, or (head trimmed by newer writes) later
                break
            out.append(msg)
            seq = msg.seq + 1
        out.append(head)
        return out

    async def keys(self, pattern: str = ">") -> list[str]:
        """Every key (matching ``pattern``, a subject filter) with a stored message
        (deleted keys' markers included)."""
        info = await self.js.stream_info(self.stream, subjects_filter=self.subject(pattern))
        subjects = info.state.subjects or {}
        return sorted(s[len(self.prefix) :] for s in subjects if s.startswith(self.prefix))

    @staticmethod
    def _message(key: str, raw: RawStreamMsg) -> KvMessage:
        headers = {str(k): str(v) for k, v in (raw.headers or {}).items()}
        at = raw.time.timestamp() if isinstance(raw.time, datetime) else 0.0
        assert raw.seq is not None
        return KvMessage(key, raw.seq, raw.data or b"", headers.get(KV_OP), headers, at)

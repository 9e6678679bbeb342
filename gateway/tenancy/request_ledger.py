"""Append ledger records and read them back, per tenant.

Writer: one JetStream publish per record on ``jetserve.ledger.<tenant>`` with a
``Nats-Msg-Id`` made of tenant and request id, so a retry (ours after a lost
ack, or a restarted gateway's) inside the duplicate window is stored once.

Reader: an ephemeral, unacknowledged pull consumer filtered on the tenant's
subject only, starting at ``since`` by the server's clock. It stops at the end
of the stream as it was when the query started, so it never waits for new
records. ``since``/``until`` filter on ``record.created`` (the gateway's clock);
the server-side start position and the early stop are only scan bounds, widened
by the topology's clock skew and append delay so they never cut off a record
that belongs in the range.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import random
import secrets
import time
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import IO, cast

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from streams.errors import JetserveError
from streams.headers import Header
from streams.request_ledger import (
    DEFAULT_LEDGER,
    LedgerRecord,
    LedgerTopology,
    decode_record,
    encode_record,
)

log = logging.getLogger(__name__)

# Fetch size for reads: big enough to amortise round trips, small enough that a
# caller stopping early (limit) hasn't pulled much it will drop.
READ_BATCH = 256
# An abandoned query's consumer (crashed reader) disappears on its own after this.
# A read's consumer outlives this much idleness (the server then drops it): long
# enough for a slow client of a streamed read (gateway/web.py) to take a chunk; a
# read that ends or is left deletes it at once.
READ_INACTIVE_S = 300.0
# A follower (LedgerReader.follow) polled less often than this is dropped by the
# server; its owner then starts again from its window's start.
FOLLOW_INACTIVE_S = 120.0


class LedgerWriteError(JetserveError):
    """The record could not be stored; the caller decides (spool, alert, fail)."""

    code = "ledger_write_failed"
    retryable = True


class LedgerWriter:
    def __init__(
        self,
        js: JetStreamContext,
        topo: LedgerTopology = DEFAULT_LEDGER,
        *,
        attempts: int = 4,
        timeout_s: float = 2.0,
        backoff_s: float = 0.1,
    ) -> None:
        self._js = js
        self.topo = topo
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s

    async def append(self, record: LedgerRecord) -> None:
        subject = self.topo.subject(record.tenant)  # validates the tenant
        data = encode_record(record)
        # Tenant-scoped: dedupe is stream-wide, and one tenant must never be
        # able to suppress another's record by reusing its request id.
        headers = {Header.MSG_ID.value: f"{record.tenant}:{record.request_id}"}
        lag = time.time() - record.created
        if lag > self.topo.max_append_delay_s:
            log.warning(
                "ledger record %s appended %.0fs after it was created: range queries "
                "ending before now may miss it",
                record.request_id,
                lag,
            )
        last: Exception | None = None
        for attempt in range(self.attempts):
            if attempt:
                # Exponential backoff with jitter; the same msg id keeps it one record.
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * random.uniform(1, 1.5))
            try:
                ack = await self._js.publish(
                    subject,
                    data,
                    timeout=self.timeout_s,
                    stream=self.topo.stream,
                    headers=dict(headers),  # publish() adds to the dict it is given
                )
            except APIError as exc:  # a refusal (too big, wrong stream): retrying won't help
                raise LedgerWriteError(
                    f"ledger refused record {record.request_id}: {exc.description or exc}"
                ) from exc
            except (TimeoutError, NoStreamResponseError, nats.errors.Error) as exc:
                # Timeouts, no responders while JetStream restarts, a reconnect in progress.
                last = exc
                continue
            if ack.duplicate:
                log.debug("ledger record %s was already stored", record.request_id)
            return
        raise LedgerWriteError(
            f"could not append ledger record {record.request_id} after "
            f"{self.attempts} attempts: {last!r}"
        )


class LedgerReader:
    def __init__(
        self,
        js: JetStreamContext,
        topo: LedgerTopology = DEFAULT_LEDGER,
        *,
        fetch_timeout_s: float = 2.0,
    ) -> None:
        self._js = js
        self.topo = topo
        # Only spent when counted records vanish mid-read (max_age, purge).
        self.fetch_timeout_s = fetch_timeout_s

    def query(
        self,
        tenant: str,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
    ) -> AsyncGenerator[LedgerRecord, None]:
        """The tenant's records with ``since <= created <= until``, in append order.

        A bad tenant id raises here, at the call. A caller that stops iterating
        early should close the iterator (``contextlib.aclosing``) so the consumer
        is deleted at once; otherwise the server drops it after ``READ_INACTIVE_S``.
        """
        subject = self.topo.subject(tenant)
        return self._query(subject, tenant, since, until, limit)

    def query_all(
        self, since: float | None = None, until: float | None = None
    ) -> AsyncGenerator[LedgerRecord, None]:
        """Every tenant's records with ``since <= created <= until`` (an operator's
        read, e.g. a rollout's arms: gateway/admin/rollout_analysis.py). It
        scans every record appended since ``since``: keep the range short."""
        return self._query(f"{self.topo.subject_prefix}.*", None, since, until, None)

    async def _query(
        self,
        subject: str,
        tenant: str | None,
        since: float | None,
        until: float | None,
        limit: int | None,
    ) -> AsyncGenerator[LedgerRecord, None]:
        if limit is not None and limit <= 0:
            return
        skew = self.topo.clock_skew_s
        name = f"ledger-read-{secrets.token_hex(8)}"
        config = ConsumerConfig(
            name=name,  # named but not durable: an ephemeral consumer
            filter_subject=subject,
            ack_policy=AckPolicy.NONE,  # read-only: nothing to redeliver
            inactive_threshold=READ_INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
        )
        if since is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.fromtimestamp(since - skew, UTC)
        # Records stored after this (server time) can't have created <= until.
        stop_after = None if until is None else until + self.topo.max_append_delay_s + skew

        info = await self._js.add_consumer(self.topo.stream, config)
        try:
            # The end of the stream as of now, for this tenant: read that many, no more.
            left = info.num_pending or 0
            if left == 0:
                return
            sub = await self._js.pull_subscribe_bind(name, stream=self.topo.stream)
            try:
                yielded = 0
                received = 0  # the consumer sequence of the last message that arrived
                while left > 0:
                    msgs = await self._fetch(sub, min(left, READ_BATCH), received)
                    if msgs is None:
                        return  # records aged out under us: nothing more to read
                    for msg in msgs:
                        meta = msg.metadata
                        received = max(received, meta.sequence.consumer or 0)
                        if stop_after is not None and meta.timestamp.timestamp() > stop_after:
                            return
                        # num_pending 0: caught up; later records arrived after we started.
                        left = 0 if meta.num_pending == 0 else left - 1
                        record = self._decode(msg, tenant)
                        if record is not None and _in_range(record, since, until):
                            yield record
                            yielded += 1
                            if limit is not None and yielded >= limit:
                                return
                        if left == 0:
                            break
            finally:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await sub.unsubscribe()
        finally:
            await self._delete(name)

    async def follow(self, since: float) -> LedgerFollow:
        """Every tenant's records from ``since`` on, and each one appended later:
        a read that goes on (:class:`LedgerFollow`), for a reader that looks at
        the same window again and again (the rollout guard) and would otherwise
        scan all of it every time."""
        name = f"ledger-follow-{secrets.token_hex(8)}"
        config = ConsumerConfig(
            name=name,
            filter_subject=f"{self.topo.subject_prefix}.*",
            ack_policy=AckPolicy.NONE,
            inactive_threshold=FOLLOW_INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(since - self.topo.clock_skew_s, UTC),
        )
        await self._js.add_consumer(self.topo.stream, config)
        try:
            sub = await self._js.pull_subscribe_bind(name, stream=self.topo.stream)
        except BaseException:
            await self._delete(name)
            raise
        return LedgerFollow(self, name, sub)

    async def _fetch(
        self, sub: JetStreamContext.PullSubscription, n: int, received: int
    ) -> list[Msg] | None:
        """``n`` messages are known to exist; a timeout means they vanished (max_age)
        or the server is slow. The consumer tells them apart: nothing pending and
        nothing delivered past ``received`` (the last consumer sequence that
        arrived) means they vanished. Delivered but not arrived means slow: a
        loaded server's batch can come after the fetch gave up, and the next
        fetch takes it first (ending the read there would cut the tail off)."""
        while True:
            try:
                msgs: list[Msg] = await sub.fetch(n, timeout=self.fetch_timeout_s)
                return msgs
            except TimeoutError:
                info = await sub.consumer_info()
                delivered = info.delivered.consumer_seq if info.delivered else 0
                if info.num_pending == 0 and (delivered or 0) <= received:
                    return None

    def _decode(self, msg: Msg, tenant: str | None) -> LedgerRecord | None:
        # Skip, don't fail: a bad record would otherwise block the tenant's
        # exports for as long as the stream retains it (deny_delete).
        try:
            record = decode_record(msg.data)
        except msgspec.DecodeError as exc:  # ValidationError included
            log.error("ledger seq %s: undecodable record: %s", msg.metadata.sequence.stream, exc)
            return None
        if tenant is None:  # every tenant's: the subject names the record's
            tenant = msg.subject.rsplit(".", 1)[-1]
        if record.tenant != tenant:  # published to the wrong subject by hand
            log.error("ledger seq %s: record of another tenant", msg.metadata.sequence.stream)
            return None
        return record

    async def _delete(self, name: str) -> None:
        # Best effort: inactive_threshold removes it anyway.
        with contextlib.suppress(nats.errors.Error, TimeoutError, APIError):
            await self._js.delete_consumer(self.topo.stream, name)

    async def sum_charges(
        self, tenant: str, since: float | None = None, until: float | None = None
    ) -> int:
        """Total ``charge_micros`` of the tenant's records in the range (exact: integers)."""
        total = 0
        async for record in self.query(tenant, since, until):
            total += record.charge_micros
        return total

    async def export_jsonl(
        self,
        tenant: str,
        since: float | None,
        until: float | None,
        out: IO[bytes] | IO[str],
    ) -> int:
        """Write one JSON object per record and line (text or binary ``out``);
        returns the number of records written."""
        # Text streams (StringIO, open(..., "w"), sys.stdout) are io.TextIOBase.
        text = cast(IO[str], out) if isinstance(out, io.TextIOBase) else None
        raw = cast(IO[bytes], out)
        n = 0
        async for record in self.query(tenant, since, until):
            line = encode_record(record) + b"\n"
            if text is not None:
                text.write(line.decode())
            else:
                raw.write(line)
            n += 1
        return n


def _in_range(record: LedgerRecord, since: float | None, until: float | None) -> bool:
    return (since is None or record.created >= since) and (until is None or record.created <= until)


class LedgerFollowLost(JetserveError):
    """The follower's consumer is gone (not polled in time, a server restart):
    what it had read still stands, what came after must be read again."""

    code = "ledger_follow_lost"
    retryable = True


class LedgerFollow:
    """A standing read of every tenant's records (:meth:`LedgerReader.follow`).
    Each :meth:`poll` returns the records appended since the last one, in append
    order; it never waits for new ones. Close it (``aclose``) when done."""

    def __init__(
        self, reader: LedgerReader, name: str, sub: JetStreamContext.PullSubscription
    ) -> None:
        self._reader = reader
        self.name = name
        self._sub = sub
        self._received = 0  # consumer sequence of the last message that arrived

    async def poll(self) -> list[LedgerRecord]:
        try:
            info = await self._sub.consumer_info()
        except NotFoundError as exc:
            raise LedgerFollowLost(f"ledger follower {self.name} is gone") from exc
        left = info.num_pending or 0
        out: list[LedgerRecord] = []
        while left > 0:
            msgs = await self._reader._fetch(self._sub, min(left, READ_BATCH), self._received)
            if msgs is None:
                break  # aged out under us
            for msg in msgs:
                meta = msg.metadata
                self._received = max(self._received, meta.sequence.consumer or 0)
                left = 0 if meta.num_pending == 0 else left - 1
                record = self._reader._decode(msg, None)
                if record is not None:
                    out.append(record)
        return out

    async def aclose(self) -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self._sub.unsubscribe()
        await self._reader._delete(self.name)

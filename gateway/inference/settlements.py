"""Settling the books through the outbox (streams/outbox.py): a request's charge
and ledger record are made durable before either store is touched, and applied
exactly once.

    settle:  publish to the outbox (the caller goes on from here: its outcome is
             durable) -> apply (Redis, then the ledger) -> delete
             (under load, as a batch: one publish and one delete for many)
    scan:    what is still in the outbox after ``grace_s`` -> apply -> delete
    orphans: a hold past its expiry (its gateway died before settling) ->
             a settlement from the frames capture's evidence -> settle

Apply is idempotent: the reconcile script applies one writer's settlement once
and answers a repeat with the charge it applied (gateway/tenancy/accounting.py),
and the ledger stores one record per tenant and request id (``Nats-Msg-Id``).
When two writers settle one request (a resumed stream followed by two
replicas), the first to reach Redis charges and records; the other records
nothing. A store that is down never turns a charge into 0, and a record is
never given up: it waits in the outbox.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from gateway.errors import GatewayError
from gateway.tenancy.accounting import Accountant
from gateway.tenancy.pricing import PriceBook
from gateway.tenancy.records import RecordHead
from gateway.tenancy.request_ledger import LedgerWriteError, LedgerWriter
from streams.deadletter import dead_letter
from streams.definitions import Topology
from streams.errors import JetserveError
from streams.outbox import Outbox, Settlement, SettlementBatch, encode_settlement
from streams.request_ledger import LedgerRecord
from streams.subjects import frames_filter
from streams.tasks import stop_task
from streams.wire import ErrorFrame, Final, Meta, Usage, decode_frame, decode_frames

log = logging.getLogger(__name__)

_BUS_ERRORS = (nats.errors.Error, TimeoutError, OSError, APIError)
SWEEP_WRITER = "sweep"
SCAN_FAILURES_IN_A_ROW = 3  # a scan stops here: a store is down, not one settlement bad
# Settlements in one outbox message at most (a record is ~0.5 KiB, a message 64).
MAX_BATCH = 64
# A read of the books waits this long at most for this gateway's stored settlements.
FLUSH_WAIT_S = 2.0


class Settlements:
    def __init__(
        self,
        js: JetStreamContext,
        outbox: Outbox,
        accountant: Accountant,
        ledger: LedgerWriter,
        gateway_id: str,
        topology: Topology,
        prices: PriceBook,
        *,
        grace_s: float = 10.0,
        on_outcome: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self._js = js
        self.outbox = outbox
        self._accountant = accountant
        self._ledger = ledger
        self.gateway_id = gateway_id
        self._topology = topology
        self._prices = prices
        self.grace_s = grace_s  # how long the settling gateway has before a scanner steps in
        self._on_outcome = on_outcome  # counts inline, deferred, recovered, ...
        self._retrying: set[asyncio.Task[None]] = set()  # owned: awaited in aclose()
        # Settlements waiting for the next group commit, and the task committing.
        self._waiting: list[tuple[Settlement, asyncio.Future[None]]] = []
        self._committer: asyncio.Task[None] | None = None  # owned: awaited in aclose()
        # Stored batches (outbox seq, settlements) waiting to be applied, in order,
        # by the applier; ``_handed``/``_applied`` count batches in and out of it.
        self._stored: list[tuple[int, list[Settlement]]] = []
        self._applier: asyncio.Task[None] | None = None  # owned: awaited in aclose()
        self._handed = self._applied = 0
        self._progress = asyncio.Condition()

    # -- the request path ------------------------------------------------------------
    async def settle(self, s: Settlement) -> None:
        """Make ``s`` durable; it is applied right after, in the background (and
        by a scanner, should this gateway die first). Never raises: what cannot be
        stored now is retried from here.

        The caller's outcome is safe once the outbox holds it, so a request is
        answered then, not after two stores' round trips more (Redis, the
        ledger, and the outbox delete: 1.5-1.9 ms of a short request's median
        answer, measured with one client against the simulator).
        ``flush()`` waits for what was stored to be applied: a read of the
        books on this gateway sees its own requests.

        Group commit: while one batch is being stored, the settlements that
        arrive wait and go together in the next, as one outbox message and one
        delete. Alone, a settlement goes at once, as itself."""
        # Shielded: a caller that goes away does not take its books with it.
        await asyncio.shield(self.submit(s))

    def submit(self, s: Settlement) -> asyncio.Future[None]:
        """Hand ``s`` to the next group commit, at once (no await: a caller
        cancelled after this leaves it handed over); done once it is stored."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((s, done))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit(), name="settlements")
        return done

    async def flush(self, timeout_s: float = FLUSH_WAIT_S) -> bool:
        """Wait until every settlement stored so far has been applied (or left
        in the outbox for a scanner, when a store refused it); at most
        ``timeout_s``: a store that is slow (the ledger's retries take seconds)
        delays a read by that much, not by the store's whole outage. Whether
        all of it was applied in time."""
        target = self._handed
        try:
            async with asyncio.timeout(timeout_s), self._progress:
                await self._progress.wait_for(lambda: self._applied >= target)
        except TimeoutError:
            return False
        return True

    async def _commit(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            try:
                await self._store_batch([s for s, _ in batch])
            except asyncio.CancelledError:
                for _, done in batch:
                    done.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 -- not swallowed: each caller raises it
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
            else:
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)

    async def _store_batch(self, batch: list[Settlement]) -> None:
        """Store ``batch`` and hand it to the applier; a bus that is down: keep
        trying in the background (a scanner applies it once stored)."""
        try:
            seq = await self._store(batch)
        except _BUS_ERRORS as exc:
            log.warning("outbox publish of %d settlements failed (%r); retrying", len(batch), exc)
            for _ in batch:
                self._on_outcome("outbox_retry")
            task = asyncio.ensure_future(self._store_later(batch))
            self._retrying.add(task)
            task.add_done_callback(self._retrying.discard)
            return
        self._stored.append((seq, batch))
        self._handed += 1
        if self._applier is None or self._applier.done():
            self._applier = asyncio.create_task(self._apply_stored(), name="settlements-apply")

    async def _apply_stored(self) -> None:
        """Apply what is stored, all of it at once: what arrives while one round
        is applied goes in the next, so the rounds grow with the load and never
        fall behind it. A batch is deleted from the outbox once all of it is
        applied (what is not stays there for a scanner)."""
        while self._stored:
            taken, self._stored = self._stored, []
            try:
                await asyncio.gather(*(self._apply_batch(seq, batch) for seq, batch in taken))
            finally:
                async with self._progress:
                    self._applied += len(taken)
                    self._progress.notify_all()

    async def _apply_batch(self, seq: int, batch: list[Settlement]) -> None:
        try:
            applied = await asyncio.gather(*(self._apply_logged(s) for s in batch))
            for ok in applied:
                self._on_outcome("inline" if ok else "deferred")
            if all(applied):
                await self._delete(seq)
        except Exception:  # logged, and kept: the outbox holds it for a scanner
            log.exception("applying outbox seq %d failed; a scanner applies it", seq)
            for _ in batch:
                self._on_outcome("deferred")

    async def _store(self, batch: list[Settlement], msg_id: str | None = None) -> int:
        """One outbox message for ``batch``: the settlement itself when alone (or
        when a batch would not fit a message, the first; the rest follow)."""
        if len(batch) > 1:
            # A republish of this batch (_store_later) reuses its id: stored once.
            msg_id = msg_id or f"batch:{self.gateway_id}:{uuid.uuid4().hex}"
            whole = SettlementBatch(settlements=batch)
            seq = await self.outbox.publish_batch(self.gateway_id, whole, msg_id)
            if seq is not None:
                return seq
            for s in batch[1:]:
                await self.outbox.publish(self.gateway_id, s)  # applied by a scanner
        return await self.outbox.publish(self.gateway_id, batch[0])

    async def _store_later(self, batch: list[Settlement]) -> None:
        """The bus was down: keep trying to store it (then a scanner applies it)."""
        delay = 0.25
        msg_id = f"batch:{self.gateway_id}:{uuid.uuid4().hex}"
        while True:
            await asyncio.sleep(delay * random.uniform(1, 1.5))
            try:
                await self._store(batch, msg_id)
                return
            except _BUS_ERRORS:
                delay = min(delay * 2, 5.0)

    async def _apply_logged(self, s: Settlement) -> bool:
        try:
            await self.apply(s)
            return True
        except (GatewayError, LedgerWriteError) as exc:
            log.warning("settlement of %s deferred: %s", s.record.request_id, exc.message)
            return False

    async def apply(self, s: Settlement) -> None:
        """Charge, then record; raise what a store answered (the caller keeps ``s``)."""
        record = await self._charge(s)
        if record is not None:
            await self._ledger.append(record)

    async def _charge(self, s: Settlement) -> LedgerRecord | None:
        """The hold reconciled to ``s``'s charge; the record to write with it
        (None: another writer settled the request first, and records it)."""
        record = s.record
        if s.actual_micros is None:
            return record
        state, charge = await self._accountant.settle_as(
            record.request_id, s.actual_micros, s.writer, org=record.org or record.tenant
        )
        if state == "other":
            return None
        if state == "none":
            # No hold and no marker: Redis lost it (a restart without its
            # append-only file). The request is still recorded, uncharged.
            log.error("no hold for %s: recorded without a charge", record.request_id)
            self._on_outcome("hold_missing")
            charge = 0
        return msgspec.structs.replace(record, charge_micros=charge)

    async def _delete(self, seq: int) -> None:
        try:
            await self.outbox.delete(seq)
        except _BUS_ERRORS as exc:
            # Left behind: a scanner applies it again, which changes nothing.
            log.warning("outbox delete of seq %d failed: %r", seq, exc)

    # -- the scanner -------------------------------------------------------------------
    async def scan(self) -> int:
        """Apply what has waited in the outbox longer than the grace; how many."""
        applied = failed = 0
        cutoff = time.time() - self.grace_s
        async for p in self.outbox.pending():
            if p.stored_at > cutoff:
                break  # oldest first: the rest is younger still
            if p.settlements is None:
                await dead_letter(self._js, p.subject, p.data, "undecodable settlement", p.seq)
                await self._delete(p.seq)
                continue
            rest: list[Settlement] = []
            why: JetserveError | None = None
            for one in p.settlements:
                left, exc = await self._apply_part(p.subject, p.seq, one)
                if left is not None:
                    rest.append(left)
                    why = exc
            if why is not None:
                if rest != p.settlements:
                    await self._keep_rest(p.seq, rest)
                # One that fails must not hold up the rest; several in a row: a
                # store is down, stop (the next scan retries, from the oldest).
                failed += 1
                if failed >= SCAN_FAILURES_IN_A_ROW:
                    raise why
                continue
            failed = 0
            await self._delete(p.seq)
            self._on_outcome("from_outbox")
            applied += 1
        return applied

    async def _apply_part(
        self, subject: str, seq: int, s: Settlement
    ) -> tuple[Settlement | None, JetserveError | None]:
        """:meth:`apply` for the scanner: what of ``s`` is left to apply (None:
        nothing) and the store's error that left it.

        Charged but not recorded (the ledger down): the record with its charge
        is what is left, and no charge. Applied again whole after Redis's
        done marker expired (``settled_ttl_s``), it would be recorded charged 0.

        A settlement no store will take (a record the ledger refuses for good,
        or a bug) goes to the dead-letter queue instead, alone (a batch's others
        are applied): retried at every scan it would stop the scanner there,
        every settlement after it with it. The bus's errors are raised."""
        try:
            record = await self._charge(s)
            if record is None:
                return None, None
            try:
                await self._ledger.append(record)
            except LedgerWriteError as exc:
                if s.actual_micros is None:
                    return s, exc
                return Settlement(record=record, writer=s.writer), exc
            return None, None
        except (GatewayError, LedgerWriteError) as exc:
            return s, exc
        except _BUS_ERRORS:
            raise
        except Exception as exc:  # not swallowed: kept aside, said loudly
            log.exception("a settlement in outbox seq %d cannot be applied: dead-lettered", seq)
            why = f"settlement not applicable: {type(exc).__name__}"
            await dead_letter(self._js, subject, encode_settlement(s), why, seq)
            self._on_outcome("dead_lettered")
            return None, None

    async def _keep_rest(self, seq: int, rest: list[Settlement]) -> None:
        """Part of outbox message ``seq`` is applied: store what is left as a
        message of its own, then delete ``seq``. Kept whole, its applied part
        would be applied again at every scan while the rest waits (a store down
        for one org, for hours), and after the ledger's duplicate window and
        Redis's done marker, recorded twice. A republish (the delete lost), or
        another gateway's scan of the same message, is stored once: its id is the
        original's sequence and the rest's, whoever scans."""
        data = encode_settlement(SettlementBatch(settlements=rest))
        msg_id = f"rest:{seq}:{hashlib.sha256(data).hexdigest()[:24]}"
        stored = await self.outbox.publish_batch(
            self.gateway_id, SettlementBatch(settlements=rest), msg_id
        )
        if stored is not None:  # (None: too big for one message; kept whole, as before)
            await self._delete(seq)
            self._on_outcome("split")

    # -- orphans ---------------------------------------------------------------------
    async def sweep(self) -> int:
        """Settle holds past their expiry from the frames capture; how many."""
        swept = 0
        for hold in await self._accountant.expired():
            s = await self.orphan(hold.tenant, hold.request_id)
            head = RecordHead.of_hold(hold) if s is None else None
            if s is None and head is not None:
                # Never announced (its gateway died before queueing it, or an
                # agent run's hold): it never ran. Its hold goes back, and its
                # record says so, charged nothing.
                record = head.unqueued(hold.cost_micros)
                await self.settle(Settlement(record=record, writer=SWEEP_WRITER, actual_micros=0))
                self._on_outcome("released")
            elif s is None:
                # The same, held by an older gateway that left no note: no record.
                await self._accountant.settle(hold.request_id, 0, SWEEP_WRITER, org=hold.org)
                self._on_outcome("released")
            else:
                # Settled in the org it was held in (its keys' hash tag), which
                # the index it was found in names even where the capture does not.
                record = msgspec.structs.replace(s.record, org=hold.org)
                await self.settle(msgspec.structs.replace(s, record=record))
                self._on_outcome("orphan")
            swept += 1
        return swept

    async def orphan(self, tenant: str, request_id: str) -> Settlement | None:
        """What the frames capture shows of a request nobody settled."""
        topo = self._topology
        stream = topo.frames_stream_of(request_id)
        subject = frames_filter(tenant, request_id, topo.frames_partitions)
        try:
            head = await self._js.get_msg(stream, seq=1, subject=subject, next=True)
            last = await self._js.get_msg(stream, subject=subject)
        except NotFoundError:
            return None
        try:
            # The capture's last message may hold many tokens: its last one counts.
            meta, frame = decode_frame(head.data or b""), decode_frames(last.data or b"")[-1]
        except msgspec.DecodeError:
            return None
        if not isinstance(meta, Meta):
            return None  # the head of the capture expired: no evidence of what it was
        if isinstance(frame, Final):
            usage, outcome, status, worker = frame.usage, frame.finish_reason, 200, frame.worker
        else:
            # A token or heartbeat carries the last token's seq; an error the next one.
            if isinstance(frame, Meta):
                tokens = 0
            elif isinstance(frame, ErrorFrame):
                tokens = max(0, frame.seq - 1)
            else:
                tokens = frame.seq
            usage = Usage(meta.prompt_tokens_est if tokens else 0, tokens)
            outcome = frame.code if isinstance(frame, ErrorFrame) else "gateway_lost"
            status, worker = (frame.status if isinstance(frame, ErrorFrame) else 502), ""
        price = self._prices.for_model(meta.model)
        record = LedgerRecord(
            request_id=request_id,
            tenant=meta.tenant,
            org=meta.org or meta.tenant,
            key_id=meta.key_id,
            op=meta.op,
            cls=meta.cls,
            model=meta.model,
            attempts=1 if isinstance(frame, Meta) else frame.attempt,
            policy="admitted:recovered",
            usage=usage,
            price_version=meta.price_version,
            charge_micros=0,
            reserved_micros=meta.reserved_micros,
            outcome=outcome,
            status=status,
            created=meta.created,
            duration_ms=0.0,
            gateway=meta.gateway,
            worker=worker,
        )
        return Settlement(record=record, writer=SWEEP_WRITER, actual_micros=price.cost(usage))

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Give stores that were down a moment; what is left the orphan sweep settles."""
        if self._committer is not None:
            await self._committer  # what was handed over is stored (or handed on)
        if self._applier is not None:
            await self._applier  # and what was stored, applied
        if self._retrying:
            await asyncio.wait(self._retrying, timeout=grace_s)
        left = list(self._retrying)
        if left:
            log.error("%d settlements not stored at shutdown", len(left))
        for task in left:
            await stop_task(task)  # a retry loop around a publish: one cancel may be dropped


async def keep_books(
    settlements: Settlements,
    summarise: Callable[[], Awaitable[None]],
    scan_s: float = 5.0,
    sweep_s: float = 30.0,
) -> None:
    """The background duty of every gateway: write the refusals' summaries
    that are due, scan the outbox, sweep orphans."""
    next_sweep = time.monotonic() + sweep_s
    while True:
        await asyncio.sleep(scan_s)
        try:
            await summarise()
            await settlements.scan()
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + sweep_s
                await settlements.sweep()
        except (GatewayError, LedgerWriteError) as exc:
            log.warning("outbox scan deferred: %s", exc.message)
        except _BUS_ERRORS as exc:
            log.warning("outbox scan deferred: %r", exc)
        except Exception:  # not swallowed: logged; the duty goes on (it would end for good)
            log.exception("outbox scan or orphan sweep failed; trying again next round")

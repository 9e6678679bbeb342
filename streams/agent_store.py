"""The run store: run records, leases, decisions and cancels in KV ``JETSERVE_RUNS``,
plus the publishers of nudges, settlement requests and run events.

Shared by the gateway (creates runs, records decisions and cancels, reads) and
the executors (own and advance runs); neither imports the other.

KV keys (run ids are ``run_<hex>``; call ids are made safe with ``agent.token``)::

    <run>                       Run             compare-and-set on every write
    <run>.lease                 LeaseRecord     one owner at a time (create / CAS, expiry)
    <run>.cancel                CancelRequest   create-only: the first request stands
    <run>.approval.<step>.<call> ApprovalDecision create-only: the first decision stands
    <key>.runs.<run>            (empty)         a root run its API key started, until it ends
    <key>.cancel                CancelRequest   the key was revoked: every run it started
                                                stops (a run checks its key as an ancestor)

Every write of a record names the revision it read (``update``): an owner whose
lease lapsed and was taken over cannot overwrite the new owner's progress, it
gets :class:`RunConflictError` and stops. The lease keeps two live executors off
one run; the revision check keeps a stale one from doing harm if it happens anyway.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from streams.agent import (
    ApprovalDecision,
    CancelRequest,
    LeaseRecord,
    Run,
    RunEvent,
    SettleMsg,
    StepMsg,
    decode_approval,
    decode_cancel_request,
    decode_lease,
    decode_run,
    encode,
    step_msg_id,
    token,
)
from streams.agent_topology import DEFAULT_AGENT, AgentTopology, ensure_agent
from streams.errors import (
    LeaseLostError,
    RunConflictError,
    RunExistsError,
    RunStoreError,
    RunTooLargeError,
)
from streams.headers import Header
from streams.kv_log import KvLog
from streams.subjects import AGENT_SETTLE, AGENT_STEP, run_cancel_subject, run_events_subject

Clock = Callable[[], float]


@dataclass(frozen=True)
class Stored:
    run: Run
    revision: int


@dataclass(frozen=True)
class Lease:
    run_id: str
    owner: str
    revision: int
    until: float


def lease_key(run_id: str) -> str:
    return f"{run_id}.lease"


def cancel_key(run_id: str) -> str:
    return f"{run_id}.cancel"


def key_runs_key(key_id: str, run_id: str = "*") -> str:
    """The index entry of a root run under the API key that started it (``*``:
    all of them, a watch filter)."""
    return f"{key_id}.runs.{run_id}"


def approval_key(run_id: str, step: int, call_id: str) -> str:
    # The step is part of it: models reuse call ids ("call_1") from step to step.
    return f"{run_id}.approval.{step}.{token(call_id)}"


class RunStore:
    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        topo: AgentTopology = DEFAULT_AGENT,
        clock: Clock = time.time,
        nc: Client | None = None,
    ) -> None:
        self.js = js
        self.kv = kv
        self.topo = topo
        self._clock = clock
        self._nc = nc

    @classmethod
    async def open(
        cls, nc: Client, topo: AgentTopology = DEFAULT_AGENT, *, executor: bool = False
    ) -> RunStore:
        js = nc.jetstream()
        return cls(js, await ensure_agent(js, topo, executor=executor), topo, nc=nc)

    # -- records ------------------------------------------------------------------

    async def get(self, run_id: str) -> Stored | None:
        try:
            entry = await self.kv.get(run_id)
        except KeyNotFoundError:
            return None
        except NatsError as exc:
            raise RunStoreError(f"run store read failed: {exc}") from exc
        assert entry.value is not None
        assert entry.revision is not None
        return Stored(decode_run(entry.value), entry.revision)

    async def create(self, run: Run) -> Stored:
        now = self._clock()
        run = msgspec.structs.replace(run, created=run.created or now, updated=now)
        try:
            rev = await self.kv.create(run.id, self._encode(run))
        except KeyWrongLastSequenceError:
            raise RunExistsError(f"run {run.id} exists") from None
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc
        return Stored(run, rev)

    async def update(self, run: Run, revision: int) -> Stored:
        """Write ``run`` over the record at ``revision``; RunConflictError if it moved."""
        run = msgspec.structs.replace(run, updated=self._clock())
        try:
            rev = await self.kv.update(run.id, self._encode(run), last=revision)
        except KeyWrongLastSequenceError:
            raise RunConflictError(f"run {run.id} changed since revision {revision}") from None
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc
        return Stored(run, rev)

    def _encode(self, run: Run) -> bytes:
        limit = self.topo.max_record_bytes
        data = encode(run)
        if len(data) > limit:
            raise RunTooLargeError(
                f"run {run.id}: record of {len(data)} bytes exceeds {limit} (conversation too long)"
            )
        return data

    def check_new(self, run: Run) -> None:
        """RunTooLargeError when a new run's record is over the bound (before any
        hold is taken for it; a run that outgrows the bound later fails at that step)."""
        self._encode(run)

    # -- runs by API key ------------------------------------------------------------

    async def index_run(self, run: Run) -> None:
        """Note a root run under its key: revoking the key finds it
        (:meth:`runs_of_key`), parked on an approval or not."""
        try:
            await self.kv.put(key_runs_key(run.key_id, run.id), b"")
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc

    async def unindex_run(self, run: Run) -> None:
        """The run ended: its key's index no longer names it (redone on redelivery)."""
        try:
            await self.kv.delete(key_runs_key(run.key_id, run.id))
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc

    async def runs_of_key(self, key_id: str) -> list[str]:
        """The root runs ``key_id`` started (ended ones included, where their
        entry's delete marker is still kept: the caller reads each run). The
        leader's subject list of the key's index, not a watch: a watch's end of
        "the initial values" can come before them (streams/kv_log.py), and a
        revocation then found no run to stop."""
        try:
            keys = await KvLog.of(self.kv).keys(key_runs_key(key_id))
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc
        return [k.rsplit(".", 1)[-1] for k in keys]

    # -- leases -------------------------------------------------------------------

    async def lease(self, run_id: str, owner: str, ttl_s: float) -> Lease | float:
        """Take the run's lease: a :class:`Lease`, or the seconds left on the
        current holder's (then try again later)."""
        key = lease_key(run_id)
        for _ in range(4):
            now = self._clock()
            value = encode(LeaseRecord(owner=owner, until=now + ttl_s))
            try:
                rev = await self.kv.create(key, value)
                return Lease(run_id, owner, rev, now + ttl_s)
            except KeyWrongLastSequenceError:
                pass
            except (NatsError, TimeoutError) as exc:
                raise _store_error(exc) from exc
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:
                continue  # released between our create and get: try again
            except NatsError as exc:
                raise RunStoreError(f"run store read failed: {exc}") from exc
            assert entry.value is not None
            assert entry.revision is not None
            held = decode_lease(entry.value)
            if held.until > now:
                # Held, possibly by another step of this same process (owners
                # are per process): either way, not ours to take.
                return held.until - now
            # Expired (its owner died or stalled): take it over, only if nobody
            # else did meanwhile.
            try:
                rev = await self.kv.update(key, value, last=entry.revision)
                return Lease(run_id, owner, rev, now + ttl_s)
            except KeyWrongLastSequenceError:
                continue
            except (NatsError, TimeoutError) as exc:
                raise _store_error(exc) from exc
        return ttl_s  # heavy contention: back off for a lease's length

    async def renew(self, lease: Lease, ttl_s: float) -> Lease:
        now = self._clock()
        value = encode(LeaseRecord(owner=lease.owner, until=now + ttl_s))
        try:
            rev = await self.kv.update(lease_key(lease.run_id), value, last=lease.revision)
        except KeyWrongLastSequenceError:
            raise LeaseLostError(f"lease on {lease.run_id} was taken over") from None
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc
        return Lease(lease.run_id, lease.owner, rev, now + ttl_s)

    async def release(self, lease: Lease) -> None:
        """Give the lease back (only if still ours); best effort: it expires anyway."""
        with contextlib.suppress(NatsError, TimeoutError):
            await self.kv.delete(lease_key(lease.run_id), last=lease.revision)

    # -- cancels and decisions ------------------------------------------------------

    async def request_cancel(self, run_id: str, reason: str) -> CancelRequest:
        """Record a cancel (create-only); the first request stands and is returned."""
        req = CancelRequest(run_id=run_id, reason=reason, at=self._clock())
        try:
            await self.kv.create(cancel_key(run_id), encode(req))
            return req
        except KeyWrongLastSequenceError:
            have = await self.cancel_request([run_id])
            return have or req
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc

    async def cancel_request(self, run_ids: Iterable[str]) -> CancelRequest | None:
        """The cancel recorded for the first of ``run_ids`` that has one (a run and
        its ancestors: cancelling any of them cancels the run)."""
        for run_id in run_ids:
            try:
                entry = await self.kv.get(cancel_key(run_id))
            except KeyNotFoundError:
                continue
            except NatsError as exc:
                raise RunStoreError(f"run store read failed: {exc}") from exc
            if entry.value:
                return decode_cancel_request(entry.value)
        return None

    async def decide(self, run_id: str, step: int, decision: ApprovalDecision) -> ApprovalDecision:
        """Record a decision on a call (create-only): the first one stands and is returned."""
        try:
            await self.kv.create(approval_key(run_id, step, decision.call_id), encode(decision))
            return decision
        except KeyWrongLastSequenceError:
            have = await self.decision(run_id, step, decision.call_id)
            return have or decision
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc

    async def decision(self, run_id: str, step: int, call_id: str) -> ApprovalDecision | None:
        try:
            entry = await self.kv.get(approval_key(run_id, step, call_id))
        except KeyNotFoundError:
            return None
        except NatsError as exc:
            raise RunStoreError(f"run store read failed: {exc}") from exc
        decision = decode_approval(entry.value) if entry.value else None
        if decision is not None and decision.call_id != call_id:
            return None  # another call's (keys are tokens of ids): never this one's
        return decision

    # -- publishing ---------------------------------------------------------------

    async def nudge(self, run_id: str, step: int, reason: str = "next", suffix: str = "") -> bool:
        """Enqueue "look at ``run_id`` at ``step``" once (``Nats-Msg-Id`` dedupe);
        True when it was a duplicate (an earlier publish of it was stored)."""
        return await self._publish(
            AGENT_STEP, encode(StepMsg(run_id, step, reason)), step_msg_id(run_id, step, suffix)
        )

    async def request_settle(self, run_id: str) -> None:
        await self._publish(AGENT_SETTLE, encode(SettleMsg(run_id)), f"{run_id}:settle")

    async def publish_status(self, run: Run, revision: int = 0) -> None:
        """The run's current status as an event (once per status change: its
        ``Nats-Msg-Id`` is the record's ``status_seq``)."""
        event = RunEvent(
            run_id=run.id,
            kind="status",
            status=run.status,
            step=run.step,
            at=self._clock(),
            revision=revision,
            reason=run.reason,
            result=run.result,
            pending_approval=run.pending_approval,
            spent=run.spent.plus(run.children_spent),
        )
        await self.publish_event(run.tenant, event, f"{run.id}:s:{run.status_seq}")

    async def publish_event(self, tenant: str, event: RunEvent, msg_id: str) -> None:
        await self._publish(run_events_subject(tenant, event.run_id), encode(event), msg_id)

    async def notify_cancel(self, run_id: str) -> None:
        """Tell every executor (core NATS, best effort) to interrupt a step of this
        run or of its descendants now; the recorded cancel is what makes it stick."""
        if self._nc is not None:
            with contextlib.suppress(NatsError):
                await self._nc.publish(run_cancel_subject(run_id), b"")

    async def _publish(self, subject: str, payload: bytes, msg_id: str) -> bool:
        """Publish with dedupe; True when the server had it already."""
        try:
            ack = await self.js.publish(subject, payload, headers={Header.MSG_ID.value: msg_id})
        except (NatsError, TimeoutError) as exc:
            raise _store_error(exc) from exc
        return bool(ack.duplicate)


def _store_error(exc: BaseException) -> RunStoreError:
    if isinstance(exc, MaxPayloadError) or (
        isinstance(exc, APIError) and "size" in (exc.description or "").lower()
    ):
        return RunTooLargeError(f"run store write refused: {exc}")
    return RunStoreError(f"run store write failed: {exc}")

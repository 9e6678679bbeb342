"""The rollout guard: one gateway of the fleet compares each canary's arms and
rolls a failing canary back (docs/rollout.md).

Every gateway runs one; the one holding the ``rollout-guard`` lease (NATS KV,
streams/leases.py) works, the others only keep trying for the lease, so a
guard that dies is replaced within the lease's ttl. While no route has a
canary, nobody contends for the lease (nor makes its bucket): a fleet without
rollouts pays nothing for the guard. The holder follows the ledger
(gateway/admin/ledger_window.py: each record read once, the last minutes kept
in memory), and every ``every_s`` judges, for each route whose current
revision has a canary, that revision's records over the guard's window
(fleet-wide: gateway/admin/rollout_analysis.py). Once evidence exists, the
holder also re-evaluates every route's evidence triggers
(gateway/admin/evidence_watch.py). When the analysis fails the canary, it
rolls back through :func:`gateway.admin.route_rollback.roll_back`, the code of
the manual rollback, to the newest earlier revision that does not canary that
deployment, conditional on the route still being at the revision it judged.
The new revision's record says why (``rollback``: automatic, the reason); the
guard counts it (``jetserve_rollout_rollbacks_total{trigger="guard"}``), logs a
``rollout_rolled_back`` event and publishes a :class:`streams.routes.RolloutEvent`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from gateway.admin.evidence_watch import EvidenceWatch
from gateway.admin.ledger_window import LedgerWindow
from gateway.admin.rollout_analysis import Analysis, analyse
from gateway.admin.route_contracts import RouteStore
from gateway.admin.route_evidence import EvidenceUpdate, merge
from gateway.admin.route_rollback import RouteConflict, roll_back
from gateway.errors import GatewayError
from gateway.inference.route_table import RouteTable
from gateway.metrics import GatewayMetrics
from gateway.tenancy.request_ledger import LedgerFollowLost, LedgerReader
from streams.errors import ProvisioningError
from streams.leases import KvLease
from streams.logs import log_event
from streams.routes import RolloutEvent, RouteRecord
from streams.subjects import ROLLOUT_EVENTS
from streams.tasks import stop_task

log = logging.getLogger(__name__)

LEASE_KEY = "rollout-guard"
ACTOR = "rollout-guard"


class RolloutGuard:
    def __init__(
        self,
        nc: Client,
        lease: Callable[[], Awaitable[KvLease]],
        table: RouteTable,
        reader: LedgerReader,
        metrics: GatewayMetrics,
        every_s: float,
        evidence: Callable[[], Awaitable[KeyValue]] | None = None,
        price_version: str = "",
        watch: EvidenceWatch | None = None,
    ) -> None:
        self._nc = nc
        self._evidence = evidence  # the evidence bucket: the judged revision gets the figures
        self._price_version = price_version
        self._make_lease = lease  # bound on first need
        self.lease: KvLease | None = None
        self.table = table
        self.store = RouteStore(table.kv, table)
        self.reader = reader
        self.metrics = metrics
        self.every_s = every_s
        self.window = LedgerWindow(reader)  # the ledger's last minutes, while the holder
        self.watch = watch  # every route's evidence triggers, while the holder
        self._stuck: set[tuple[str, int]] = set()  # failing, nothing to roll back to: said once
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rollout-guard")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        if self.lease is not None:
            await self.lease.release()
        await self._resign()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except (nats.errors.Error, TimeoutError, ProvisioningError, LedgerFollowLost) as exc:
                # The window, lost, starts again next tick.
                log.warning("rollout guard: the bus failed (%r); trying again", exc)
            await asyncio.sleep(self.every_s)

    async def tick(self) -> list[str]:
        """One round: hold the lease, then judge every canary and, when due,
        every route's evidence; the routes rolled back."""
        now = time.time()
        canaries = [r for r in map(self.table.get, self.table.names()) if _has_canary(r)]
        watching = self.watch is not None and await self.watch.active(now)
        if not canaries and not watching:
            if self.lease is not None and self.lease.held:
                await self.lease.release()  # another gateway takes over at once when needed
            await self._resign()
            return []
        if self.lease is None:
            self.lease = await self._make_lease()
        leader = await self.lease.hold()
        self.metrics.rollout_guard_leader.set(1 if leader else 0)
        if not leader:
            await self._resign()
            return []
        evaluate = self.watch is not None and self.watch.due(now)
        if evaluate:
            assert self.watch is not None
            await self.watch.refresh()
        spans = [r.contract.rollout.guard.window_s for r in canaries if r and r.contract.rollout]
        if self.watch is not None:
            spans.append(self.watch.horizon_s())
        await self.window.advance(max(spans) + self.reader.topo.clock_skew_s, now)
        self.metrics.rollout_window_records.set(len(self.window))
        rolled = []
        for record in canaries:
            assert record is not None
            name = record.contract.name
            analysis = analyse(record, self.window.samples(name, record.revision), now)
            self._observe(analysis)
            if analysis.decision == "failing" and await self._roll_back(record, analysis):
                rolled.append(name)
        if evaluate:
            assert self.watch is not None
            await self.watch.evaluate(self.window, now)
        return rolled

    async def _resign(self) -> None:
        """Not (or no longer) the holder: keep no window, report no figures."""
        self.metrics.rollout_guard_leader.set(0)
        await self.window.aclose()
        self.window.horizon_s = 0.0
        self.metrics.rollout_window_records.set(0)
        if self.watch is not None:
            self.watch.clear()

    def _observe(self, analysis: Analysis) -> None:
        g = analysis.guard
        if g is None or g.error_ratio is None:
            return
        self.metrics.rollout_guard_ratio.labels(analysis.route, "error").set(g.error_ratio)
        if g.ttft_p95_ratio is not None:
            self.metrics.rollout_guard_ratio.labels(analysis.route, "ttft_p95").set(
                g.ttft_p95_ratio
            )

    async def _roll_back(self, record: RouteRecord, analysis: Analysis) -> bool:
        name, canary = analysis.route, record.contract.rollout
        assert canary is not None
        assert canary.canary is not None
        reason = f"rollout guard: {analysis.reason}"
        try:
            written, changed = await roll_back(
                self.store,
                name,
                to=None,
                reason=reason,
                actor=ACTOR,
                automatic=True,
                expected=record.revision,  # only the revision judged
                without_canary=canary.canary.candidate,
            )
        except RouteConflict as exc:
            log.info("rollout guard: %s moved on before its rollback (%s)", name, exc.message)
            return False
        except GatewayError as exc:  # no earlier revision without this canary
            if (name, record.revision) not in self._stuck:
                self._stuck.add((name, record.revision))
                log_event(
                    log, "rollout_guard_stuck", logging.ERROR, route=name,
                    revision=record.revision, reason=analysis.reason, error=exc.message,
                )  # fmt: skip
            return False
        if not changed:
            return False
        assert written.rollback is not None
        self.metrics.rollout_rollbacks.labels(name, "guard").inc()
        await self._record_evidence(record, analysis)
        log_event(
            log, "rollout_rolled_back", logging.WARNING, route=name, revision=written.revision,
            from_revision=record.revision, to_revision=written.rollback.to_revision,
            reason=analysis.reason,
        )  # fmt: skip
        event = RolloutEvent(
            route=name,
            revision=written.revision,
            from_revision=record.revision,
            to_revision=written.rollback.to_revision,
            reason=reason,
            at=written.updated_at,
        )
        try:
            await self._nc.publish(ROLLOUT_EVENTS, msgspec.json.encode(event))
        except nats.errors.Error as exc:  # the route history has it regardless
            log.warning("rollout guard: event for %s not published: %r", name, exc)
        return True

    async def _record_evidence(self, record: RouteRecord, analysis: Analysis) -> None:
        """The guard's final figures, in the judged revision's evidence."""
        if self._evidence is None:
            return
        figures = {
            "decision": analysis.decision,
            "reason": analysis.reason,
            "at": time.time(),
            "figures": msgspec.to_builtins(analysis.guard),
        }
        try:
            kv = await self._evidence()
            await merge(kv, record, self._price_version, EvidenceUpdate(guard=figures))
        except (nats.errors.Error, TimeoutError, ProvisioningError, GatewayError) as exc:
            # The route history keeps the reason regardless.
            log.warning("rollout guard: evidence of %s not recorded: %r", record.contract.name, exc)


def _has_canary(record: RouteRecord | None) -> bool:
    return (
        record is not None
        and record.contract.rollout is not None
        and (record.contract.rollout.canary is not None)
    )

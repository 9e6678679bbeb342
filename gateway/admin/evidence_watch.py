"""The evidence watch: the rollout guard's lease holder re-evaluates every
route's evidence triggers on its own, so a trigger that fires is seen when it
fires, not when someone next reads ``jetserve routes evidence`` (docs/rollout.md).

Every ``every_s`` (and only once someone has attached evidence: until the
bucket exists the watch costs one bucket lookup per interval), for each route
of the route table: the newest evidence at or before its current revision,
the static triggers (fingerprint, adapter, engine, price, expiry;
streams/evidence.py) and the SLO-regression trigger, whose recent figures come
from the guard's in-memory ledger window (gateway/admin/ledger_window.py), not
from a scan. What fired is exported as ``jetserve_route_evidence_due{route,kind}``
(1 while fired). A trigger newly seen to fire is counted
(``jetserve_route_evidence_triggers_fired_total``), logged as an
``evidence_due`` event and published on ``jetserve.rollout.events``
(:class:`streams.evidence.EvidenceDueEvent`). A new lease holder sees what is
already fired as new: it reports it once more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from gateway.admin import slo_regression
from gateway.admin.ledger_window import LedgerWindow
from gateway.admin.route_evidence import live_versions, newest
from gateway.inference.pools import PoolView
from gateway.inference.route_table import RouteTable
from gateway.metrics import GatewayMetrics
from streams.evidence import Evidence, EvidenceDueEvent, Trigger, triggers
from streams.logs import log_event
from streams.routes import RouteRecord
from streams.subjects import ROLLOUT_EVENTS

log = logging.getLogger(__name__)


class EvidenceWatch:
    def __init__(
        self,
        nc: Client,
        bucket: Callable[[], Awaitable[KeyValue | None]],
        table: RouteTable,
        metrics: GatewayMetrics,
        price_version: str,
        every_s: float,
        pools: PoolView | None = None,
    ) -> None:
        self._nc = nc
        self._bucket = bucket
        self._kv: KeyValue | None = None
        self.table = table
        self.metrics = metrics
        self.price_version = price_version
        self.every_s = every_s
        self.pools = pools  # the workers' engine versions
        self._next = 0.0  # when the next evaluation is due
        # route -> (the evidenced revision, its evidence), read again each evaluation.
        self._evidence: dict[str, tuple[int, Evidence]] = {}
        self._searched: dict[str, int] = {}  # route -> the revision searched down from
        self.fired: dict[str, dict[str, Trigger]] = {}  # route -> kind -> trigger

    async def active(self, now: float) -> bool:
        """Whether there is evidence to watch: the bucket exists (looked up at
        most once an interval until it does, then kept)."""
        if self._kv is None and now >= self._next:
            self._kv = await self._bucket()
            self._next = now if self._kv is not None else now + self.every_s
        return self._kv is not None

    def due(self, now: float) -> bool:
        return self._kv is not None and now >= self._next

    async def refresh(self) -> None:
        """Read each route's evidence (newest at or before its current revision)."""
        kv = self._kv
        assert kv is not None
        for name in self.table.names():
            current = self.table.get(name)
            if current is None:
                continue
            known = self._evidence.get(name)
            if known is not None:  # anything newer, else the one known (read again)
                found = await newest(kv, name, current.revision, known[0] - 1)
            elif self._searched.get(name) != current.revision:
                found = await newest(kv, name, current.revision)  # every earlier revision
            else:  # searched at this revision: only an attach to it can be new
                found = await newest(kv, name, current.revision, current.revision - 1)
            self._searched[name] = current.revision
            if found is None:
                self._evidence.pop(name, None)
            else:
                self._evidence[name] = (found[0].revision, found[0])
        for gone in set(self._evidence) - set(self.table.names()):
            del self._evidence[gone]

    def horizon_s(self) -> float:
        """How far back the SLO comparison reads: the longest guard window of a
        route whose evidence has a baseline."""
        spans = [
            slo_regression.policy_of(r).window_s
            for name, (_, ev) in self._evidence.items()
            if (r := self.table.get(name)) is not None and slo_regression.baseline(ev)
        ]
        return max(spans, default=0.0)

    async def evaluate(self, window: LedgerWindow, now: float | None = None) -> None:
        """The triggers of every watched route, from the evidence read and the window."""
        at = time.time() if now is None else now
        self._next = at + self.every_s
        for name in sorted(set(self._evidence) | set(self.fired)):
            current = self.table.get(name)
            found = self._evidence.get(name)
            fired: list[Trigger] = []
            if current is not None and found is not None:
                evidence = found[1]
                versions = live_versions(self.pools, current)
                fired = triggers(evidence, current, self.price_version, at, versions)
                slo = self._slo(window, evidence, current, at)
                if slo is not None:
                    fired.append(slo)
            await self._report(name, current, found[1] if found else None, fired, at)

    def _slo(
        self, window: LedgerWindow, evidence: Evidence, current: RouteRecord, at: float
    ) -> Trigger | None:
        found = slo_regression.baseline(evidence)
        if found is None:
            return None
        source, base = found
        policy = slo_regression.policy_of(current)
        since = at - policy.window_s
        samples = window.samples(current.contract.name, current.revision)
        recent = slo_regression.production(samples, current, since)
        return slo_regression.regression(base, recent, policy, f"{source} r{evidence.revision}")

    async def _report(
        self,
        name: str,
        current: RouteRecord | None,
        evidence: Evidence | None,
        fired: list[Trigger],
        at: float,
    ) -> None:
        before = self.fired.get(name, {})
        now = {t.kind: t for t in fired}
        for kind in before.keys() - now.keys():
            self.metrics.evidence_due.remove(name, kind)
        new = [t for kind, t in now.items() if kind not in before]
        for t in now.values():
            self.metrics.evidence_due.labels(name, t.kind).set(1)
        for t in new:
            self.metrics.evidence_fired.labels(name, t.kind).inc()
        if now:
            self.fired[name] = now
        else:
            self.fired.pop(name, None)
        if not new or current is None or evidence is None:
            return
        log_event(
            log, "evidence_due", logging.WARNING, route=name, revision=current.revision,
            evidence_revision=evidence.revision,
            triggers="; ".join(f"{t.kind}: {t.detail}" for t in new),
        )  # fmt: skip
        event = EvidenceDueEvent(
            route=name,
            revision=current.revision,
            evidence_revision=evidence.revision,
            triggers=tuple(new),
            at=at,
        )
        try:
            await self._nc.publish(ROLLOUT_EVENTS, msgspec.json.encode(event))
        except nats.errors.Error as exc:  # the gauge and the log have it regardless
            log.warning("evidence watch: event for %s not published: %r", name, exc)

    def clear(self) -> None:
        """This gateway no longer holds the lease: its figures stop being the fleet's."""
        for name, kinds in self.fired.items():
            for kind in kinds:
                self.metrics.evidence_due.remove(name, kind)
        self.fired.clear()
        self._next = 0.0

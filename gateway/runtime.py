"""Everything a gateway process holds open, built and torn down in one place:
NATS (with provisioning), Redis, tenancy, accounting, idempotency, the ledger,
the dispatcher and the NATS ingress. Both HTTP apps (public and admin) share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from redis.exceptions import RedisError

from gateway.admin.evidence_watch import EvidenceWatch
from gateway.admin.rollout_guard import LEASE_KEY, RolloutGuard
from gateway.config import GatewayConfig
from gateway.inference.coalesce_fleet import FleetCoalescing
from gateway.inference.deadletters import MaxDeliveriesWatch
from gateway.inference.depth_share import LEASE_KEY as DEPTH_LEASE_KEY
from gateway.inference.depth_share import DepthShare
from gateway.inference.dispatch import Dispatcher
from gateway.inference.fair_gate import FairGate
from gateway.inference.hedge_budget import SharedHedgeBudget
from gateway.inference.kv_routing import KvRouting
from gateway.inference.pools import PoolView
from gateway.inference.route_table import RouteTable
from gateway.inference.service import InferenceService
from gateway.inference.settlements import Settlements, keep_books
from gateway.inference.shedding import QueueWatch
from gateway.ingress.nats_api import NatsIngress
from gateway.ingress.runs_nats import RunsNatsIngress
from gateway.metrics import GatewayMetrics
from gateway.runs.service import RunsService
from gateway.runs.settle import RunSettler
from gateway.tenancy.accounting import Accountant
from gateway.tenancy.accounting_migrate import check_tagged
from gateway.tenancy.idempotency import IdempotencyStore
from gateway.tenancy.keys import Tenancy
from gateway.tenancy.request_ledger import LedgerReader, LedgerWriter
from streams.agent_store import RunStore
from streams.agent_topology import AgentTopology
from streams.connect import connect
from streams.evidence import bind_evidence, ensure_evidence
from streams.leases import KvLease, ensure_leases
from streams.outbox import DEFAULT_OUTBOX, Outbox, ensure_outbox
from streams.provision import ensure_routes, ensure_topology
from streams.redis_client import RedisClient, open_redis
from streams.request_ledger import DEFAULT_LEDGER, ensure_ledger
from streams.tasks import stop_task

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    cfg: GatewayConfig
    nc: Client
    js: JetStreamContext
    redis: RedisClient
    gateway: InferenceService
    ledger_reader: LedgerReader
    runs: RunsService | None = None

    async def readiness(self) -> dict[str, bool]:
        redis_ok = True
        try:
            await self.redis.ping()
        except (RedisError, OSError):
            redis_ok = False
        return {"nats": self.nc.is_connected, "redis": redis_ok}

    async def refresh_queue_depth(self) -> None:
        """The queue-depth and pool gauges, from the shedding watch's last look
        and the members view (no I/O here: a scrape must not add JetStream API load)."""
        m = self.gateway.metrics
        if self.gateway.pools is not None:
            seen = self.gateway.pools.workers()
            for family in m.pool_workers.collect():  # pools now gone: 0
                for sample in family.samples:
                    seen.setdefault(sample.labels["deployment"], 0)
            for dep, n in seen.items():
                m.pool_workers.labels(dep).set(n)
        watch = self.gateway.queue_watch
        if watch is None:
            return
        pools = self.gateway.pools
        for key, load in watch.loads.items():
            cls, _, token = key.partition("@")  # streams.depth.queue_key
            if token:
                deployment = pools.deployment_of(token) if pools is not None else None
                gauge = m.pool_queue_depth.labels(cls, deployment or token)
                gauge.set(load.depth + load.ack_pending)
                continue
            m.queue_depth.labels(cls).set(load.depth + load.ack_pending)
            m.consumer_pending.labels(cls).set(load.depth)
            m.consumer_ack_pending.labels(cls).set(load.ack_pending)


class _Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=_Service)


async def _started(stack: contextlib.AsyncExitStack, service: S) -> S:
    """Start ``service``; the stack stops it (in reverse order of starting)."""
    await service.start()
    stack.push_async_callback(service.stop)
    return service


async def _connected(
    stack: contextlib.AsyncExitStack, cfg: GatewayConfig
) -> tuple[Client, RedisClient]:
    nc = await connect(cfg.nats_url, f"gateway-{cfg.gateway_id}", cfg.nats_auth)

    async def drain() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(nc.drain(), 5)

    stack.push_async_callback(drain)
    rds = open_redis(cfg.redis_url, password=cfg.redis_password, cluster=cfg.redis_cluster)
    stack.push_async_callback(rds.aclose)
    return nc, rds


def check_windows(cfg: GatewayConfig) -> None:
    """An Idempotency-Key retry must find on the bus what it finds in Redis: the
    first run's frames and its place in the work queue's de-duplication."""
    window = cfg.idempotency_window_s
    topo = cfg.topology
    if window > topo.frames.max_age_s or window > topo.limits.duplicate_window_s:
        raise ValueError(
            f"idempotency window {window:.0f}s exceeds the frames capture "
            f"({topo.frames.max_age_s:.0f}s) or the work queue's de-duplication window "
            f"({topo.limits.duplicate_window_s:.0f}s)"
        )


@contextlib.asynccontextmanager
async def open_runtime(cfg: GatewayConfig) -> AsyncIterator[Runtime]:
    """Everything started in order and stopped in reverse; a start that fails
    stops what had started before it."""
    check_windows(cfg)
    async with contextlib.AsyncExitStack() as stack:
        nc, rds = await _connected(stack, cfg)
        await check_tagged(rds)  # fail closed on accounting keys from before the {org} tags
        js = nc.jetstream()
        # The lane counts are the stream's: every gateway and worker uses them.
        cfg = dataclasses.replace(cfg, topology=await ensure_topology(js, cfg.topology))
        ledger_topo = dataclasses.replace(DEFAULT_LEDGER, replicas=cfg.topology.replicas)
        await ensure_ledger(js, ledger_topo, update=False)  # changed only by an operator
        outbox_topo = dataclasses.replace(DEFAULT_OUTBOX, replicas=cfg.topology.replicas)
        await ensure_outbox(js, outbox_topo)
        # The hedge budget is the fleet's (Redis), not this replica's.
        hedge_budget = await _started(stack, SharedHedgeBudget(rds))
        dispatcher = await _started(
            stack,
            Dispatcher(
                nc,
                js,
                cfg.gateway_id,
                cfg.topology,
                cfg.max_buffered_frames,
                hedge_budget=hedge_budget,
            ),
        )
        # Route contracts: loaded before serving, then followed live.
        route_table = await _started(stack, RouteTable(await ensure_routes(js, cfg.topology)))
        metrics = GatewayMetrics(cfg.metrics_tenants)
        queue_watch = QueueWatch(js, cfg.topology)
        queue_watch.on_look = lambda source: metrics.depth_looks.labels(source).inc()
        if cfg.depth_reader_renew_s > 0:
            renew = cfg.depth_reader_renew_s

            async def depth_lease() -> KvLease:
                kv = await ensure_leases(js, cfg.topology.replicas)
                return KvLease(kv, DEPTH_LEASE_KEY, cfg.gateway_id, ttl_s=3 * renew)

            share = DepthShare(
                nc, cfg.gateway_id, depth_lease, queue_watch.take_look, queue_watch.poke, renew
            )
            queue_watch.shared(share)
            metrics.depth_reader.set_function(lambda: float(share.leading))
        else:
            metrics.depth_reader.set(1)  # it reads for itself
        await _started(stack, queue_watch)
        fair_gate = None
        if cfg.fair:
            fair_gate = FairGate(
                queue_watch,
                lambda cls, n: metrics.fair_waiting.labels(cls).set(n),
                lambda cls, way: metrics.fair_passes.labels(cls, way).inc(),
            )
            stack.push_async_callback(fair_gate.stop)
        accountant = Accountant(rds)
        settlements = Settlements(
            js,
            Outbox(js, outbox_topo),
            accountant,
            # Impatient: what it cannot store at once waits in the outbox.
            LedgerWriter(js, ledger_topo, attempts=2, backoff_s=0.1),
            cfg.gateway_id,
            cfg.topology,
            cfg.prices,
            grace_s=cfg.outbox_grace_s,
            on_outcome=lambda outcome: metrics.settlements.labels(outcome).inc(),
        )
        kv = None
        if cfg.kv_index:
            kv = await _started(
                stack,
                KvRouting(nc, js, cfg.topology, lambda src: metrics.kv_routes.labels(src).inc()),
            )
            index, routing = kv.index, kv
            metrics.kv_index_entries.set_function(lambda: index.entries)
            metrics.kv_index_replicas.set_function(lambda: index.replicas)
            metrics.kv_index_members.set_function(lambda: routing.members)
        gw = InferenceService(
            cfg,
            Tenancy(rds, cfg.key_cache_s, key_secret=cfg.key_secret),
            accountant,
            IdempotencyStore(rds, cfg.idempotency_window_s),
            # Patient: a JetStream leader election (a node lost) takes seconds.
            LedgerWriter(js, ledger_topo, attempts=8, backoff_s=0.25),
            settlements,
            dispatcher,
            metrics,
            routes=route_table,
            queue_watch=queue_watch,
            fair_gate=fair_gate,
            fleet_coalescing=FleetCoalescing(rds),
            pools=await _started(stack, PoolView(js, cfg.topology, route_table)),
            kv=kv,
        )
        stack.push_async_callback(gw.aclose)  # after the ingresses below have stopped
        if cfg.rollout_guard_every_s > 0:
            every = cfg.rollout_guard_every_s

            async def lease() -> KvLease:
                # Bound when a route first has a canary: no bucket, no traffic before.
                kv = await ensure_leases(js, cfg.topology.replicas)
                return KvLease(kv, LEASE_KEY, cfg.gateway_id, ttl_s=max(5.0, 3 * every))

            async def evidence() -> KeyValue:
                return await ensure_evidence(js, cfg.topology.replicas)

            async def existing_evidence() -> KeyValue | None:
                return await bind_evidence(js)

            reader = LedgerReader(js, ledger_topo)
            watch = EvidenceWatch(
                nc,
                existing_evidence,
                route_table,
                metrics,
                cfg.prices.version,
                cfg.evidence_watch_every_s,
                gw.pools,
            )
            guard = RolloutGuard(
                nc, lease, route_table, reader, metrics, every, evidence, cfg.prices.version,
                watch if cfg.evidence_watch_every_s > 0 else None,
            )  # fmt: skip
            await _started(stack, guard)
        await _started(stack, NatsIngress(nc, gw))
        await _started(stack, MaxDeliveriesWatch(nc, js, cfg.topology, gw.metrics))
        run_store = await RunStore.open(nc, AgentTopology(replicas=cfg.topology.replicas))
        runs = RunsService(gw, run_store)
        await _started(stack, RunsNatsIngress(nc, runs))
        await _started(stack, RunSettler(js, run_store, gw.accountant, gw.ledger, cfg.gateway_id))
        books = keep_books(settlements, gw.books.summarise, cfg.outbox_scan_s, cfg.sweep_s)
        stack.push_async_callback(stop_task, asyncio.create_task(books))
        yield Runtime(cfg, nc, js, rds, gw, LedgerReader(js, ledger_topo), runs)

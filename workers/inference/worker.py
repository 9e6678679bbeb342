"""The inference worker: pulls requests from the class subjects while its engine
has room, runs them through an engine adapter and streams frames back.

Ack timing (DESIGN.md, "The request path" step 4): ``in_progress()`` while
waiting for the first token, a confirmed ack once it is sent
(workers/inference/delivery.py). Before that point a crash means a clean
redelivery; after it the receiver sees heartbeats stop.

Cancellation: the worker subscribes to the request's cancel subject, then
reads its durable cancel mark (streams/marks.py), so a cancel sent before the
worker was ready still stops it; a cancel closes the engine's stream (the
engine sees the disconnect and stops generating).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import MsgAlreadyAckdError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from streams.connect import OPEN, BusAuth, connect
from streams.consumer import PullConsumer, PullLoop, Source
from streams.deadletter import dead_letter
from streams.definitions import DEFAULT_TOPOLOGY, Topology
from streams.depth import LookFollower
from streams.headers import Header
from streams.logs import frames_of, log_event
from streams.marks import CancelMarks, FailureCounts
from streams.membership import SHARED, Adapter, Membership
from streams.pools import adapter_pool, pool_consumer_name, pool_token
from streams.provision import await_topology
from streams.rendezvous import DEFAULT_DEPTH
from streams.routes import Deployment
from streams.subjects import RequestClass, class_of, excess_subject, pool_of, pool_subject
from streams.tasks import stop_task
from streams.tracing import Span, Tracer
from streams.vectors import floats
from streams.wire import HEDGE_ATTEMPT_BASE, InferenceRequest, Usage, decode_request, encode
from workers.engines.base import Delta, EngineAdapter, EngineLoad, closing
from workers.errors import (
    DeadlineExceeded,
    EngineConnectionLost,
    EngineStreamBroken,
    EngineUnreachable,
    ResponseTooLarge,
    WorkerError,
    WorkerStopping,
)
from workers.inference.admission import Admission, AdmissionConfig
from workers.inference.affinity import LanePuller, StartRate
from workers.inference.batching import BatchingMode, EmbedBatcher
from workers.inference.cancels import CancelWatch
from workers.inference.delivery import confirm_ack, delivery_limit
from workers.inference.kv_reporter import KvReporter
from workers.inference.metrics import WorkerMetrics
from workers.inference.pool_source import PoolSource
from workers.inference.relay import FrameSender
from workers.inference.token_count import LocalTokenCounter
from workers.probe import ProbeServer, probe_server

log = logging.getLogger(__name__)

# Looks at the engine in a row at --max-inflight with the engine's room unused
# before the worker says so in its log, and the least time between two such lines.
CAPPED_LOOKS = 10
CAPPED_LOG_EVERY_S = 600.0

# Rank order: interactive first, then agent runs' model calls (a person usually
# waits on a run too), then embeddings, then batch.
DEFAULT_CLASSES = (
    RequestClass.INTERACTIVE,
    RequestClass.AGENT,
    RequestClass.EMBED,
    RequestClass.BATCH,
)


EXCESS_POLL_S = 0.05  # a class's excess subject: each pull's expiry


async def _end(msg: Msg) -> None:
    """Terminate ``msg`` (no redelivery) unless it is acked already."""
    with contextlib.suppress(MsgAlreadyAckdError, nats.errors.Error):
        await msg.term()


# Attempts of a request whose engine stream broke before its first token.
BROKEN_STREAM_ATTEMPTS = 2


@dataclass(frozen=True)
class WorkerConfig:
    nats_url: str
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    nats_auth: BusAuth = OPEN  # the worker role's credential; OPEN only with --insecure
    classes: tuple[RequestClass, ...] = DEFAULT_CLASSES
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    heartbeat_s: float = 1.0
    poll_s: float = 1.0  # long-poll expiry of one pull request
    # Up to how long pulls grow while the worker is quiet and its queues stay
    # empty (streams/consumer.py, idle cost); a lower class, whose polling pull
    # holds a slot, grows to a quarter of it (as its poll_s is a quarter).
    idle_poll_s: float = 8.0
    load_poll_s: float = 0.5  # how often to read the engine's own metrics
    # How often to probe the engine's /health while it is up (every load poll
    # while it is down): readiness may lag this long, admission never does.
    health_poll_s: float = 2.0
    drain_timeout_s: float = 30.0
    retry_backoff_s: float = 0.2
    topology: Topology = DEFAULT_TOPOLOGY
    otel_exporter: str | None = None  # span export (``otel`` extra); None: ids only
    # The route deployment this worker serves (streams.routes); None: it serves
    # only requests whose route lists no candidates.
    deployment: Deployment | None = None
    # What the engine's /v1/models says it serves, advertised in the membership
    # bucket: its base model ids (gateways list only served names) and its LoRA
    # adapters (a worker with a deployment pulls one pool per adapter).
    models: tuple[str, ...] = ()
    adapters: tuple[Adapter, ...] = ()
    embed_batch_max: int = 32  # inputs per batched engine call (1: no batching)
    embed_batch_delay_ms: float = 5.0  # longest a request waits for its batch to fill
    # auto: batch only for an engine that runs each call alone (docs/batching.md).
    embed_batching: BatchingMode = "auto"
    # The model's tokenizer.json (or its directory): exact per-request usage of a
    # batched call counted in-process; None: the engine's /tokenize, per input.
    tokenizer: str | None = None
    # Lane ownership (streams/rendezvous.py): the workers that pull each lane,
    # and how far above its share of lanes one may own.
    lane_depth: int = DEFAULT_DEPTH
    # The engine's KV cache events (vLLM's --kv-events-config ZMQ PUB endpoint,
    # e.g. tcp://127.0.0.1:5557): followed and published to the fleet's KV index
    # (workers/inference/kv_reporter.py); None: not followed.
    kv_events: str | None = None
    kv_events_topic: str = ""


class Worker:
    def __init__(self, cfg: WorkerConfig, engine: EngineAdapter) -> None:
        self.cfg = cfg
        self.engine = engine
        self.admission = Admission(cfg.admission)
        self._stop = asyncio.Event()
        self.consumer = PullConsumer(
            self._handle, graceful_timeout_s=cfg.drain_timeout_s, name=f"worker {cfg.worker_id}"
        )
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self.ready = asyncio.Event()
        self.completed = 0
        self.metrics = WorkerMetrics()
        self.embed_batcher = EmbedBatcher(
            engine,
            cfg.embed_batch_max,
            cfg.embed_batch_delay_ms / 1000,
            self.metrics.embed_batch_size.observe,
            mode=cfg.embed_batching,
            counter=LocalTokenCounter(cfg.tokenizer) if cfg.tokenizer else None,
        )
        self.tracer = Tracer(f"jetserve-worker-{cfg.worker_id}", cfg.otel_exporter)
        self.engine_up = False
        self._capped_looks = 0  # looks in a row at the cap with the engine's room unused
        self._capped_logged = -math.inf  # loop time of the last such log line
        self._ranks = {c.value: rank for rank, c in enumerate(cfg.classes)}
        self._health_due = 0.0  # loop time of the next /health probe
        self._deployment = cfg.deployment.name if cfg.deployment else ""
        self.lanes: list[LanePuller] = []
        self._members: Membership | None = None
        self.engine_version = ""  # what the engine reports (streams/membership.py)
        self.starts = StartRate()  # its load, as the members hear it
        self._cancels: CancelWatch | None = None
        self._failures: FailureCounts | None = None
        self._acks: set[asyncio.Task[bool]] = set()  # confirmations still running
        self.kv: KvReporter | None = None  # the engine's KV events, when followed
        self.looks: LookFollower | None = None  # the fleet depth reader's looks
        self._adapter_pools: dict[str, PoolSource] = {}  # adapter pool -> its puller

    async def run(self) -> None:
        """Serve until :meth:`shutdown`, then drain."""
        cfg, topo = self.cfg, self.cfg.topology
        nc = self._nc = await connect(cfg.nats_url, cfg.worker_id, cfg.nats_auth)
        try:
            js = self._js = nc.jetstream()
            # The lane counts are the stream's (whatever this worker was configured with).
            topo = await await_topology(js, topo)
            self.cfg = cfg = dataclasses.replace(cfg, topology=topo)
            self._failures = FailureCounts(js, topo)
            try:
                await self._failures.open()
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("failure counts not ready (%r): tried again on use", exc)
            self._cancels = CancelWatch(nc, CancelMarks(js, topo), topo.limits.max_age_s)
            await self._cancels.start()
            self.looks = LookFollower(nc)
            await self.looks.start()
            await self._observe_engine()
            dep = cfg.deployment.name if cfg.deployment else ""
            for rank, cls in enumerate(cfg.classes):
                self.consumer.add(await self._class_puller(rank, cls, topo.consumer_name(cls)))
                if cls in topo.excess_classes:
                    durable = topo.excess_consumer_name(cls)
                    self.consumer.add(await self._class_puller(rank, cls, durable, excess=True))
            members = self._members = Membership(
                js,
                cfg.worker_id,
                topo.replicas,
                depth=cfg.lane_depth,
                load_factor=topo.lane_load_factor,
                deployment=dep,
                load=self.starts.value,
                models=cfg.models,
                adapters=cfg.adapters,
                engine=self.engine_version,
                classes=tuple(c.value for c in cfg.classes),
            )
            await members.start()
            self.lanes = self._lane_pullers(SHARED)
            for lane in self.lanes:
                self.consumer.add(lane)
            if dep:
                # Its deployment's pool: routed requests only its workers may serve.
                self.consumer.add(PoolSource(js, topo, dep, self._pool_sources))
                # One pool per adapter it holds: requests for one go only there.
                for adapter in cfg.adapters:
                    pool = adapter_pool(dep, adapter.name)
                    source = self._adapter_pools[pool] = PoolSource(
                        js, topo, pool, self._pool_sources
                    )
                    self.consumer.add(source)
            self.metrics.lane_members.set_function(lambda: len(members.members))
            self.metrics.lane_stale_pullers.set_function(
                lambda: sum(lane.stale for lane in self.lanes)
            )
            if cfg.kv_events:
                kv = self.kv = KvReporter(
                    nc,
                    cfg.worker_id,
                    cfg.kv_events,
                    cfg.kv_events_topic,
                    outcome=lambda outcome: self.metrics.kv_learnt.labels(outcome).inc(),
                )
                self.metrics.kv_keys.set_function(lambda: len(kv.tracker.held()))
                self.metrics.kv_blocks.set_function(lambda: kv.tracker.blocks)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(self.consumer.run())
                poller = tg.create_task(self._poll_engine())
                heartbeat = tg.create_task(members.run())
                kv_feed = tg.create_task(self.kv.run()) if self.kv is not None else None
                self.ready.set()
                log.info("worker %s serving %s", cfg.worker_id, list(cfg.classes))
                await self._stop.wait()
                await members.leave()
                # Closed admission ends the pulls; a lane's late arrivals go back.
                await self.admission.close()
                # Until done: a loop around a NATS request can drop one cancel
                # (streams/tasks.py), and the task group would wait on it for good.
                for task in (poller, heartbeat, kv_feed):
                    if task is not None:
                        await stop_task(task)
                self.consumer.shutdown()
                await serving
                log.info("worker %s drained", cfg.worker_id)
        finally:
            # Every handler has finished: let the last ack confirmations end, flush
            # the last frames and leave. (drain() would wait on the pull
            # subscriptions' expired requests.)
            if self._acks:
                await asyncio.wait(self._acks, timeout=5)
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await nc.flush(timeout=2)
            await self.embed_batcher.aclose()  # after the drain: no member still waits
            if self._cancels is not None:
                await self._cancels.stop()
            await nc.close()
            self.tracer.shutdown()
            log.info("worker %s disconnected", cfg.worker_id)

    async def shutdown(self) -> None:
        self._stop.set()

    def _rank_of(self, msg: Msg) -> int:
        """The rank of the class whose puller took this message's slot."""
        return self._ranks.get(class_of(msg.subject), 0)

    def _quiet(self) -> bool:
        """Nothing in flight and nothing waiting for a slot: empty queues may be
        polled less often (a polling pull holds a slot: with few slots, a long
        one would keep a waiting class out)."""
        return self.consumer.inflight == 0 and self.admission.waiters == 0

    async def _class_puller(
        self, rank: int, cls: RequestClass, durable: str, *, excess: bool = False
    ) -> PullLoop:
        """A puller of one of the class's plain consumers (its own, its excess,
        its pool's). One message per pull, and only with a slot in hand. A
        polling fetch holds its slot, so lower classes poll briefly: an idle
        batch queue does not keep slots from interactive work, and a class's
        excess (a flood's, held back by the gateways) polls as briefly: its slots
        go first to the class's in-turn requests. Embeddings waiting behind one
        may share its batch (workers/inference/batching.py)."""
        cfg, js = self.cfg, self._js
        assert js is not None
        more = cfg.embed_batch_max - 1 if cls is RequestClass.EMBED else 0
        brief = rank > 0 or excess
        poll = cfg.poll_s / 4 if brief else cfg.poll_s
        sub = await js.pull_subscribe_bind(durable, cfg.topology.stream_of(cls))
        return PullLoop(
            sub,
            self.consumer.start,
            slots=self.admission.slots(rank, excess),
            # An excess is empty but for floods: short pulls, resting between
            # them without a slot, so a burst of in-turn work finds its slots free.
            poll_s=EXCESS_POLL_S if excess else poll,
            more=more,
            idle_poll_s=cfg.idle_poll_s / 4 if brief else cfg.idle_poll_s,
            quiet=self._quiet,
            rest_s=poll if excess else None,
            # A lower class's empty queue takes no slot under load, nor the last free one.
            peek=rank > 0 and not excess,
            scarce=lambda: self.admission.free_slots() <= 1,
            # From the fleet's depth reader's looks while they are fresh: one
            # CONSUMER.INFO less per peek (docs/scale.md, the depth reader).
            known_pending=lambda: self.looks.pending(durable) if self.looks else None,
            on_peek=lambda source: self.metrics.pending_peeks.labels(source).inc(),
        )

    def _lane_pullers(self, pool: str) -> list[LanePuller]:
        """One puller of the lanes of each lane class, shared or of ``pool``."""
        cfg, nc, members = self.cfg, self._nc, self._members
        assert nc is not None
        assert members is not None
        return [
            LanePuller(
                nc,
                cfg.topology,
                cls,
                rank,
                self.admission,
                members,
                self.consumer.start,
                cfg.poll_s,
                lambda event: self.metrics.lane_events.labels(event).inc(),
                idle_poll_s=cfg.idle_poll_s,
                quiet=self._quiet,
                pool=pool,
            )
            for rank, cls in enumerate(cfg.classes)
            if cls in cfg.topology.lane_classes
        ]

    async def _pool_sources(self, token: str, deployment: str) -> list[Source]:
        """The pullers of this worker's deployment pool (it exists now)."""
        sources: list[Source] = [
            await self._class_puller(rank, cls, pool_consumer_name(token, cls))
            for rank, cls in enumerate(self.cfg.classes)
        ]
        lanes = self._lane_pullers(deployment)
        self.lanes += lanes  # counted in the lane metrics
        return [*sources, *lanes]

    def probe(self, host: str, port: int) -> ProbeServer:
        """/metrics, /healthz and /readyz (NATS connected, engine healthy)."""
        return probe_server(self.metrics.registry, self.checks, host, port)

    def checks(self) -> dict[str, bool]:
        return {"nats": self.connected, "engine": self.engine_up}

    async def _poll_engine(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.load_poll_s)
            await self._observe_engine()

    async def _observe_engine(self) -> None:
        load = await self.engine.load()
        await self.admission.observe(load)
        now = asyncio.get_running_loop().time()
        # A load that says nothing (the scrape failed) is a reason to look now.
        if not self.engine_up or now >= self._health_due or load == EngineLoad():
            self.engine_up = await self.engine.healthy()
            self._health_due = now + self.cfg.health_poll_s
            if self.engine_up:  # an engine replaced behind its URL reports its new build
                self.engine_version = await self.engine.version() or self.engine_version
                if self._members is not None:
                    self._members.set_engine(self.engine_version)
                await self._follow_served()
        m = self.metrics
        m.engine_up.set(1 if self.engine_up else 0)
        m.engine_waiting.set(load.waiting or 0)
        m.engine_kv_usage.set(load.kv_usage or 0)
        m.kv_headroom.set(self.admission.headroom())
        self._note_cap(load, now)

    def _note_cap(self, load: EngineLoad, now: float) -> None:
        """Count the time this worker serves as many requests as --max-inflight
        lets it while the engine has room for more (nothing waiting, KV to
        spare): the engine's batch is then the worker's cap, not the engine's
        (a cap of 16 before vLLM's 128 cost 10 % of single-input embeddings at
        32 clients, docs/batching.md). Said once in the log after CAPPED_LOOKS
        looks in a row."""
        # The messages being handled: with the engine's room unused none waits for
        # KV blocks (engine_has_room says so), so each is a request being served.
        serving = self.consumer.inflight
        cap = max(1, self.cfg.admission.max_inflight - self.cfg.admission.reserve)
        if serving < cap or not self.admission.engine_has_room():
            self._capped_looks = 0
            return
        self.metrics.capped.inc(self.cfg.load_poll_s)
        self._capped_looks += 1
        if self._capped_looks >= CAPPED_LOOKS and now - self._capped_logged >= CAPPED_LOG_EVERY_S:
            self._capped_logged = now
            log_event(
                log, "capped", worker=self.cfg.worker_id, serving=serving,
                max_inflight=self.cfg.admission.max_inflight, engine_waiting=load.waiting,
                engine_kv_usage=self.admission.engine.kv_usage,  # None: no KV cache to budget
                hint="the engine had room: set --max-inflight to its max_num_seqs",
            )  # fmt: skip

    async def _follow_served(self) -> None:
        """Follow the LoRA adapters the engine serves now (vLLM loads and unloads
        them at run time): advertise them, and pull the pool of each one added,
        stop pulling the pool of each one gone."""
        members, dep = self._members, self.cfg.deployment
        found = await self.engine.served()
        if found is None or members is None:
            return
        models, adapters = found
        if (models, adapters) == (members.mine.models, members.mine.adapters):
            return
        members.set_served(models, adapters)
        self._event("adapters_changed", None, "", adapters=[a.name for a in adapters])
        if dep is None:
            return
        js = self._js
        assert js is not None
        want = {adapter_pool(dep.name, a.name) for a in adapters}
        for pool in sorted(want - self._adapter_pools.keys()):
            source = PoolSource(js, self.cfg.topology, pool, self._pool_sources)
            self._adapter_pools[pool] = source
            self.consumer.add(source)
        for pool in sorted(self._adapter_pools.keys() - want):
            gone = self._adapter_pools.pop(pool)
            await self.consumer.remove(gone)
            self.lanes = [lane for lane in self.lanes if lane not in gone.sources]

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def _handle(self, msg: Msg) -> None:
        """Serve one message; its admission slot is already held (released here)."""
        blocks = 0
        try:
            try:
                req = decode_request(msg.data)
            except msgspec.DecodeError as exc:
                # Poison: keep it with the reason, never redeliver it, carry on.
                js = self._js
                assert js is not None
                seq = msg.metadata.sequence.stream if msg.metadata.sequence else None
                await dead_letter(js, msg.subject, msg.data, f"undecodable request: {exc}", seq)
                self._event("dead_lettered", None, class_of(msg.subject), code="poison", seq=seq)
                await msg.term()
                self.metrics.requests.labels(class_of(msg.subject), "poison").inc()
                return
            try:
                blocks = await self._reserve(msg, req)
            except WorkerStopping:
                # Nothing emitted, nothing started: the next worker takes it now,
                # not after this one's drain or the server's ack wait.
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()
                self.metrics.redeliveries.labels(req.cls, "shutdown").inc()
                self._event("redelivered", req, req.cls, code="shutdown")
                return
            self.starts.tick()
            self.metrics.inflight.inc()
            try:
                await self._serve(msg, req)
            finally:
                self.metrics.inflight.dec()
        finally:
            excess = msg.subject == excess_subject(class_of(msg.subject))
            await self.admission.release(blocks, self._rank_of(msg), excess)
            self.metrics.kv_headroom.set(self.admission.headroom())

    async def _reserve(self, msg: Msg, req: InferenceRequest) -> int:
        """This request's KV blocks (its prompt + max_tokens). While they would
        not fit it waits its turn, telling the server the message is still ours."""
        tokens = req.prompt_tokens_est + req.max_tokens
        if self.admission.fits_now(tokens):
            return await self.admission.reserve_blocks(tokens)
        self.metrics.block_waits.labels(req.cls).inc()
        waiting = asyncio.create_task(self.admission.reserve_blocks(tokens))
        beat = self.cfg.topology.limits.ack_wait_s / 3
        attempt = req.attempt_base + (msg.metadata.num_delivered or 1)
        watch = self._cancels
        assert watch is not None
        with watch.watch(req.id, attempt) as cancelled:
            gone = asyncio.ensure_future(cancelled.wait())
            try:
                while True:
                    left = max(0.0, req.deadline - time.time())
                    done, _ = await asyncio.wait(
                        {waiting, gone},
                        timeout=min(beat, left),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if waiting in done:
                        return waiting.result()
                    if gone in done or time.time() >= req.deadline:
                        # Cancelled, or past its deadline, while it waited: it gives
                        # its place up (the queue's head: nothing else of this worker
                        # got blocks behind it) with none reserved, and _serve ends
                        # it, engine untouched.
                        return 0
                    with contextlib.suppress(nats.errors.Error):
                        await msg.in_progress()
            finally:
                gone.cancel()
                if not waiting.done():
                    await stop_task(waiting)

    async def _serve(self, msg: Msg, req: InferenceRequest) -> None:
        nc = self._nc
        assert nc is not None
        attempt = req.attempt_base + (msg.metadata.num_delivered or 1)
        sender = FrameSender(nc, req.reply, attempt, self.cfg.heartbeat_s)
        if time.time() >= req.deadline:
            # Expired in the queue: the engine is never called.
            await sender.error(
                "deadline_exceeded",
                "request deadline passed before it was served",
                status=504,
                retryable=False,
            )
            await msg.term()
            self._event("refused", req, req.cls, code="deadline_exceeded")
            self.metrics.requests.labels(req.cls, "deadline_exceeded").inc()
            return
        dep = self.cfg.deployment
        if req.candidates and (dep is None or dep.name not in req.candidates):
            # Fallback only to a candidate of the same contract: hand it back at
            # once, engine untouched and nothing emitted, for a listed deployment.
            await msg.nak()
            self._event("redelivered", req, req.cls, code="not_candidate")
            self.metrics.redeliveries.labels(req.cls, "not_candidate").inc()
            return
        watch = self._cancels
        assert watch is not None
        await watch.check(req.id)  # its own mark, only after a reconnect or a spill
        with watch.watch(req.id, attempt) as cancelled:
            if cancelled.is_set():
                # Cancelled before it started: nobody waits, but a reader of the
                # frames capture (a resumed or re-run caller) learns why.
                await sender.error(
                    "cancelled", "the request was cancelled before it started", status=499,
                    retryable=True,
                )  # fmt: skip
                await msg.term()
                self.metrics.requests.labels(req.cls, "cancelled").inc()
                self._event("cancelled", req, req.cls, started=False)
                return
            await self._attempt(msg, req, sender, attempt, cancelled)

    async def _attempt(
        self,
        msg: Msg,
        req: InferenceRequest,
        sender: FrameSender,
        attempt: int,
        cancelled: asyncio.Event,
    ) -> None:
        span = self.tracer.start(
            "jetserve.attempt",
            req.traceparent,
            {
                "gen_ai.request.model": req.model,
                "jetserve.class": req.cls,
                "jetserve.attempt": attempt,
                "jetserve.worker": self.cfg.worker_id,
            },
        )
        work = asyncio.create_task(self._run_engine(msg, req, sender, span))
        beats = asyncio.create_task(sender.heartbeats())
        waiter = asyncio.create_task(cancelled.wait())
        try:
            await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                # The client went away: abort the engine call now (its stream is
                # closed, so the engine stops). Cancel until done: a cancel can
                # be dropped by a wait_for inside (Python 3.11).
                await stop_task(work)
                await _end(msg)  # not redelivered (a first token's ack may never have gone)
                self.metrics.requests.labels(req.cls, "cancelled").inc()
                self._event("cancelled", req, req.cls, started=sender.started)
            else:
                await work
        except asyncio.CancelledError:
            # Drain timed out or the process is stopping.
            await stop_task(work)
            if sender.closed:
                # Its end went out (an error frame, a hand-over) before the
                # message was ended: end it, never hand it to another worker.
                await _end(msg)
            elif sender.started:
                await sender.error(
                    "stream_interrupted", "worker shut down mid-stream", status=502, retryable=False
                )
                await _end(msg)  # its first token's ack may never have gone
                self._event("interrupted", req, req.cls, code="shutdown", started=True)
            else:
                await msg.nak()  # nothing emitted: another worker takes it now
                self.metrics.redeliveries.labels(req.cls, "shutdown").inc()
                self._event("redelivered", req, req.cls, code="shutdown")
            raise
        finally:
            waiter.cancel()
            beats.cancel()
            span.set("jetserve.tokens_sent", sender.seq)
            outcome = sender.outcome or ("cancelled" if cancelled.is_set() else "handed_back")
            span.end(outcome, sender.ended_ns)

    def _ack(self, msg: Msg, cls: str, done: asyncio.Event) -> None:
        """Ack at the first token, confirmed beside the stream (delivery.py)."""

        def unconfirmed() -> None:
            self.metrics.acks_unconfirmed.labels(cls).inc()

        keep_alive = self.cfg.topology.limits.ack_wait_s / 3
        task = asyncio.create_task(confirm_ack(msg, keep_alive, done, unconfirmed))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _run_engine(
        self, msg: Msg, req: InferenceRequest, sender: FrameSender, span: Span
    ) -> None:
        remaining = req.deadline - time.time()
        ticker = asyncio.create_task(self._in_progress_until_started(msg, sender))
        done = asyncio.Event()  # the attempt has ended: an unconfirmed ack tries once more
        started_at = time.monotonic()
        ttft = 0.0
        headers = dict(req.headers)
        if traceparent := span.traceparent:
            headers["traceparent"] = traceparent  # the engine joins under this attempt
            if req.tracestate:
                headers["tracestate"] = req.tracestate
        try:
            async with asyncio.timeout(remaining):
                span.event("engine_call")
                if req.op == "embedding":
                    result = await self.embed_batcher.embed(req.body, req.id, headers, req.deadline)
                    span.event("engine_done")
                    # The answer first, then the ack (as a stream's first token):
                    # an answer that cannot be sent (over the bus's message
                    # size) fails the request instead of leaving it acked, unanswered.
                    await sender.final(
                        finish_reason="stop",
                        usage=result.usage,
                        model=result.model or req.model,
                        worker=self.cfg.worker_id,
                        deployment=self._deployment,
                        # Packed float32 to a gateway that reads them (streams/vectors.py).
                        embeddings=(
                            result.vectors
                            if req.packed_vectors
                            else [floats(v) for v in result.vectors]
                        ),
                        engine_ms=(time.monotonic() - started_at) * 1000,
                    )
                    self._ack(msg, req.cls, done)
                    self._observe_done(req, started_at, 0.0, result.usage)
                    return
                # Where the engine's KV events stand: its prefill's blocks come after.
                kv = self.kv if req.prefix_keys else None
                since = kv.tracker.mark() if kv is not None else 0
                # Closed on any exit, cancellation included: a stream left open
                # (or back in the pool) keeps the engine generating.
                events = self.engine.generate(
                    req.op, engine_body(req, self.engine), req.id, headers
                )
                async with closing(events):
                    async for event in events:
                        if isinstance(event, Delta):
                            await sender.token(
                                event.text,
                                event.tool_calls,
                                event.finish_reason,
                                event.logprobs,
                                event.index,
                                event.reasoning,
                            )
                            if sender.seq == 1:
                                ttft = (time.monotonic() - started_at) * 1000
                                span.event("first_token")
                                ticker.cancel()
                                self._ack(msg, req.cls, done)
                        else:
                            span.event("engine_done")
                            if not sender.started:
                                ticker.cancel()
                                self._ack(msg, req.cls, done)
                            await sender.final(
                                finish_reason=event.finish_reason,
                                usage=event.usage,
                                model=event.model or req.model,
                                worker=self.cfg.worker_id,
                                deployment=self._deployment,
                                ttft_ms=ttft,
                                engine_ms=(time.monotonic() - started_at) * 1000,
                            )
                            self._observe_done(req, started_at, ttft / 1000, event.usage)
                            if kv is not None:
                                # Its keys, tied to the blocks its prefill stored.
                                kv.tracker.learn(
                                    req.prefix_keys,
                                    since,
                                    event.usage.prompt_tokens,
                                    event.usage.cached_tokens,
                                )
            self.completed += 1
        except TimeoutError:
            await self._fail(
                msg, sender, DeadlineExceeded("deadline exceeded while generating"), req
            )
        except WorkerError as exc:
            await self._fail(msg, sender, exc, req)
        except nats.errors.MaxPayloadError:
            # A frame the relay let through over the bus's limit: no retry helps
            # (redelivered, it would run again on the engine, every ack wait).
            too_big = ResponseTooLarge("A frame of the answer is over the message bus's limit.")
            await self._fail(msg, sender, too_big, req)
        except nats.errors.Error:
            # The bus, not a bug (a reconnect's full buffer, a closed connection):
            # as before, unacked, the request comes back for another attempt.
            raise
        except Exception as exc:  # noqa: BLE001 - not swallowed: the request fails with it
            # A bug (an adapter's, this worker's): the request ends now, in one
            # error frame, not at its deadline. Its frames to the log, not its
            # message (it may quote the request).
            name = type(exc).__name__
            self._event("internal_error", req, req.cls, error=name, frames=frames_of(exc))
            await self._fail(msg, sender, WorkerError(f"worker internal error ({name})"), req)
        finally:
            done.set()
            ticker.cancel()

    def _learn(self, kv: KvReporter, req: InferenceRequest, since: int, prompt_tokens: int) -> None:
        """Tie the request's prefix keys to the blocks its prefill stored."""
        before = kv.tracker.learnt
        kv.tracker.learn(req.prefix_keys, since, prompt_tokens)
        self.metrics.kv_learnt.labels(
            "learnt" if kv.tracker.learnt > before else "unattributed"
        ).inc()

    def _observe_done(
        self, req: InferenceRequest, started: float, ttft_s: float, usage: Usage
    ) -> None:
        m = self.metrics
        e2e = time.monotonic() - started
        m.requests.labels(req.cls, "ok").inc()
        m.duration.labels(req.cls).observe(e2e)
        m.tokens.labels(req.cls, "input").inc(usage.prompt_tokens)
        m.tokens.labels(req.cls, "output").inc(usage.completion_tokens)
        if ttft_s:
            m.ttft.labels(req.cls).observe(ttft_s)
            if usage.completion_tokens > 1:
                m.tpot.labels(req.cls).observe((e2e - ttft_s) / (usage.completion_tokens - 1))

    async def _fail(
        self,
        msg: Msg,
        sender: FrameSender,
        exc: WorkerError,
        req: InferenceRequest | None = None,
    ) -> None:
        cls = class_of(msg.subject)
        delivered = msg.metadata.num_delivered or 1
        # The code and status, not the engine's message: an engine may echo input
        # in it. A failed connection's own message (the engine's address) helps.
        detail = {"detail": exc.message} if isinstance(exc, EngineUnreachable) else {}
        self._event("engine_error", req, cls, code=exc.code, status=exc.status,
                    delivery=delivered, started=sender.started, **detail)  # fmt: skip
        if sender.started:
            # Mid-stream failures are never retried silently (the client saw tokens).
            err = exc
            if not isinstance(exc, EngineStreamBroken | DeadlineExceeded):
                err = EngineStreamBroken(exc.client_message)
            await sender.error(err.code, err.client_message, status=err.status, retryable=False)
            self.metrics.requests.labels(cls, err.code).inc()
            return
        # The route's retry policy narrows the worker's own (never widens it).
        topo = self.cfg.topology
        limit = topo.limits.max_attempts
        eligible = exc.retryable
        if isinstance(exc, EngineConnectionLost):
            # The engine's connection broke before its first token (an engine
            # restarting while the request queued or prefilled, after its 200):
            # nothing was emitted, so another attempt is safe. One only: a request
            # that breaks its engine each time must not take down engine after engine.
            eligible, limit = True, min(limit, BROKEN_STREAM_ATTEMPTS)
        if req is not None:
            limit = min(limit, req.retry_max or limit)
            eligible = eligible and (not req.retry_on or exc.code in req.retry_on)
        # Failed attempts, not deliveries: a hand-back is no failure (delivery.py).
        failures = None
        if eligible and req is not None and self._failures is not None:
            failures = await self._failures.add(req.id)
        failures = failures or delivered
        if eligible and failures < limit and delivered < delivery_limit(topo, msg):
            # The one retry owner before the first token: the next candidate's
            # pool when the route has one, else JetStream redelivery to any
            # worker of this pool; inside the request's original deadline.
            if req is not None and await self._hand_over(msg, req, sender):
                self.metrics.redeliveries.labels(cls, "fallback").inc()
                self._event("fallback", req, cls, code=exc.code, failures=failures)
                return
            await msg.nak(delay=self.cfg.retry_backoff_s * failures)
            self.metrics.redeliveries.labels(cls, exc.code).inc()
            self._event("redelivered", req, cls, code=exc.code, failures=failures)
            return
        await sender.error(exc.code, exc.client_message, status=exc.status, retryable=exc.retryable)
        if eligible:
            # Every attempt failed: keep the request for inspection, with why.
            js = self._js
            assert js is not None
            seq = msg.metadata.sequence.stream if msg.metadata.sequence else None
            reason = f"{failures} failed attempts; last {exc.code}: {exc.message}"
            await dead_letter(js, msg.subject, msg.data, reason, seq)
            self._event("dead_lettered", req, cls, code=exc.code, failures=failures, seq=seq)
        await msg.term()
        self.metrics.requests.labels(cls, exc.code).inc()

    async def _hand_over(self, msg: Msg, req: InferenceRequest, sender: FrameSender) -> bool:
        """Fallback inside the contract: publish ``req`` to the pool of the
        candidate after this worker's deployment, tell the reader where it is
        now, and end this message; False when there is no such candidate (or
        the publish failed: the caller redelivers)."""
        if pool_of(msg.subject) is None or not req.candidates:
            return False
        dep = self.cfg.deployment.name if self.cfg.deployment else ""
        later = req.candidates[req.candidates.index(dep) + 1 :] if dep in req.candidates else []
        if req.adapter:
            # An adapter's request moves only to a candidate whose worker holds it.
            members = self._members
            pools = [adapter_pool(d, req.adapter) for d in later]
            later = [p for p in pools if members is not None and members.live(p)]
        if not later:
            return False
        attempt = req.attempt_base + (msg.metadata.num_delivered or 1)
        moved = msgspec.structs.replace(req, attempt_base=attempt)
        headers = dict(msg.headers or {})
        # Not the original's dedupe id, and one per target pool and copy (not per
        # attempt): an original run again after a hand-over whose end was lost
        # (this worker killed between the publish and the term) hands over a copy
        # that is stored once, not a second one there; a hedge copy (numbered from
        # HEDGE_ATTEMPT_BASE) hands over its own.
        copy = "h" if attempt >= HEDGE_ATTEMPT_BASE else ""
        headers[Header.MSG_ID] = f"{req.id}.f{copy}-{pool_token(later[0])}"
        js = self._js
        assert js is not None
        try:
            ack = await js.publish(
                pool_subject(pool_token(later[0]), req.cls), encode(moved), headers=headers
            )
        except (nats.errors.Error, TimeoutError, APIError) as exc:
            log.warning("fallback to %s failed (%r): redelivered here instead", later[0], exc)
            return False
        sender.closed = True  # this attempt is over: a shutdown now ends the message
        # The note before the end: a reader checking the queue never finds the
        # request gone from both places.
        await sender.moved(ack.stream, ack.seq)
        await msg.term()
        return True

    def _event(self, event: str, req: InferenceRequest | None, cls: str, **fields: Any) -> None:
        """A structured log line (streams/logs.py): ids and codes, never request text."""
        log_event(
            log, event, request_id=req.id if req else None, tenant=req.tenant if req else None,
            cls=cls, worker=self.cfg.worker_id, **fields,
        )  # fmt: skip

    async def _in_progress_until_started(self, msg: Msg, sender: FrameSender) -> None:
        beat = self.cfg.topology.limits.ack_wait_s / 3
        while not sender.started:
            await asyncio.sleep(beat)
            if not sender.started:
                # One failed tick (a reconnect's full buffer) must not end the
                # ticking: the message would be redelivered mid-prefill and run twice.
                with contextlib.suppress(nats.errors.Error):
                    await msg.in_progress()


def engine_body(req: InferenceRequest, engine: EngineAdapter) -> Mapping[str, Any]:
    """The body the engine gets: with its prefix cache salted by the request's cache
    scope (its tenant's, unless the route shares prefixes) where the engine salts
    by ``cache_salt``; a client's own salt is folded in, never used as it is (one
    tenant could otherwise name another's)."""
    if not req.cache_scope or not engine.salts_cache:
        return req.body
    own = req.body.get("cache_salt")
    seed = f"{req.cache_scope}\0{own if isinstance(own, str) else ''}"
    salt = hashlib.blake2b(seed.encode(), digest_size=16).hexdigest()
    return {**req.body, "cache_salt": salt}

"""The agent executor: a durable pull consumer of step nudges (``agent-executor``
on ``JETSERVE_AGENT``), one run per lease, one step per message.

For each message: take the run's lease (held by another executor: nak with a
delay of what is left of it); run the step (``workers.agent.step``) while a
keeper renews the lease and tells JetStream the message is in progress; then
ack, nak or terminate as the step says. The ack comes only after everything
the step decided is durable in the run record. A lost lease (taken over after
a stall) or a lost compare-and-set means another executor owns the run now:
this one stops and leaves the message alone.

Stuck-step detection: a step running past ``step_timeout_s`` is cancelled and,
by ``stuck_policy``, the run fails with the reason ("fail") or the step goes
back to the queue for another executor ("retry", at most ``stuck_retries``
times, then the run fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from streams.agent import StepMsg, decode_step
from streams.agent_store import Lease, RunStore
from streams.connect import connect
from streams.consumer import Limit, PullConsumer, PullLoop
from streams.deadletter import dead_letter
from streams.errors import LeaseLostError, RunConflictError, RunStoreError, RunTooLargeError
from streams.patience import patiently
from streams.provision import await_topology
from streams.subjects import RUN_CANCEL_WILDCARD
from streams.tasks import stop_task
from tools import (
    EffectLedger,
    EffectLedgerConfig,
    EffectLedgerError,
    Registry,
    ToolDispatcher,
    ToolMetrics,
)
from workers.agent.config import ExecutorConfig
from workers.agent.crash import DELIVERY, STORED_AT, CrashPoints
from workers.agent.errors import StepInterrupted
from workers.agent.guard import Guard
from workers.agent.handle import RunHandle
from workers.agent.lease_keeper import Held, kept
from workers.agent.metrics import AgentMetrics
from workers.agent.model import ModelClient
from workers.agent.spawn import spawn_tool
from workers.agent.step import Stepper, Verdict
from workers.probe import ProbeServer, probe_server

log = logging.getLogger(__name__)

_POISON_DELIVERIES = 10  # an executor error this many times fails the run


class Executor:
    def __init__(
        self,
        cfg: ExecutorConfig,
        registry: Registry,
        *,
        crash: CrashPoints | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        if spawn_tool().name not in registry:
            registry.register(spawn_tool())
        self.crash = crash or CrashPoints()
        self.metrics = metrics or AgentMetrics()
        self.ready = asyncio.Event()
        self._slots = Limit(cfg.concurrency)
        # A step past its grace is cancelled: not acked, so another executor redoes it.
        self._consumer = PullConsumer(
            self._serve, graceful_timeout_s=cfg.drain_timeout_s, name=f"executor {cfg.executor_id}"
        )
        self._guards: dict[str, Guard] = {}
        # Effectful calls that outlived their step (its lease lost, a drain cut
        # twice): owned here until they record their outcome, awaited at the end.
        self._effects: set[asyncio.Future[Any]] = set()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._store: RunStore | None = None
        self._stepper: Stepper | None = None

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def shutdown(self) -> None:
        self._consumer.shutdown()

    def request_stop(self) -> None:
        """:meth:`shutdown` from a signal handler (sync)."""
        self._consumer.shutdown()

    async def run(self) -> None:
        """Serve until :meth:`shutdown`, then drain."""
        cfg = self.cfg
        nc = self._nc = await connect(cfg.nats_url, cfg.executor_id, cfg.nats_auth)
        try:
            js = self._js = nc.jetstream()
            # The inference queue (its model calls, class "agent"): the stream only.
            # Its layout and frames partitions are the fleet's, whatever its config says.
            topo = await await_topology(js, cfg.topology, consumers=False)
            if topo.frames_partitions != cfg.topology.frames_partitions:
                log.info("frames capture in %d partitions (the fleet's)", topo.frames_partitions)
            self.cfg = cfg = dataclasses.replace(cfg, topology=topo)
            store = self._store = await patiently(
                lambda: RunStore.open(nc, cfg.agent, executor=True)
            )
            effects = EffectLedgerConfig(replicas=cfg.agent.replicas)
            dispatcher = ToolDispatcher(
                self.registry,
                ledger=await patiently(lambda: EffectLedger.open(js, effects)),
                nc=nc,
                metrics=ToolMetrics(self.metrics.registry),
            )
            models = ModelClient(nc, js, cfg.executor_id, topo, cfg.heartbeat_timeout_s)
            self._stepper = Stepper(
                cfg, store, self.registry, dispatcher, models, self.crash, self.metrics, nc
            )
            notices = await nc.subscribe(RUN_CANCEL_WILDCARD, cb=self._on_cancel)
            sub = await js.pull_subscribe_bind(cfg.agent.step_consumer, cfg.agent.stream)
            # One message per pull, only with a free slot, started at once: nothing
            # waits in a buffer while its ack_wait runs out. (A pull for more would
            # hold the first message until the rest arrived or the pull expired.)
            self._consumer.add(
                PullLoop(sub, self._consumer.start, slots=self._slots, poll_s=cfg.poll_s)
            )
            self.ready.set()
            log.info("agent executor %s serving", cfg.executor_id)
            try:
                await self._consumer.run()
            finally:
                await notices.unsubscribe()
            log.info("agent executor %s drained", cfg.executor_id)
        finally:
            if self._effects:  # each bounded by its tool's timeout
                await asyncio.wait(self._effects, timeout=cfg.drain_timeout_s)
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await nc.flush(timeout=2)
            await nc.close()

    def probe(self, host: str, port: int) -> ProbeServer:
        """/metrics, /healthz and /readyz (NATS connected, serving)."""

        def checks() -> dict[str, bool]:
            return {"nats": self.connected, "serving": self.ready.is_set()}

        return probe_server(self.metrics.registry, checks, host, port)

    async def _on_cancel(self, msg: Msg) -> None:
        run_id = msg.subject.rsplit(".", 1)[-1]
        for guard in self._guards.values():
            if run_id in guard.scope:
                guard.cancelled.set()

    # -- one message ----------------------------------------------------------------

    async def _serve(self, msg: Msg) -> None:
        try:
            await self._handle(msg)
        finally:
            await self._slots.release()

    async def _handle(self, msg: Msg) -> None:
        store, stepper = self._store, self._stepper
        assert store is not None
        assert stepper is not None
        try:
            nudge = decode_step(msg.data)
        except msgspec.DecodeError as exc:
            assert self._js is not None
            seq = msg.metadata.sequence.stream if msg.metadata.sequence else None
            await dead_letter(self._js, msg.subject, msg.data, f"undecodable step: {exc}", seq)
            await msg.term()
            self.metrics.steps.labels("poison").inc()
            return
        delivery = msg.metadata.num_delivered or 1
        DELIVERY.set(delivery)  # this task's context: the crash points read it
        STORED_AT.set(msg.metadata.timestamp.timestamp())
        try:
            got = await store.lease(nudge.run_id, self.cfg.executor_id, self.cfg.lease_s)
        except RunStoreError as exc:
            log.warning("run %s: lease unavailable: %s", nudge.run_id, exc.message)
            await _settle_msg(msg, Verdict("nak", 1.0))
            return
        if not isinstance(got, Lease):
            # Another executor holds the run (usually about to let go): look again
            # soon, backing off towards the time its lease has left.
            self.metrics.steps.labels("busy").inc()
            delay = min(got, 0.05 * 2 ** min(delivery - 1, 8), self.cfg.lease_s)
            await _settle_msg(msg, Verdict("nak", max(delay, 0.02)))
            return
        held = Held(got)
        started = time.monotonic()
        self.metrics.inflight.inc()
        try:
            verdict = await self._step(msg, nudge, held, delivery)
            if verdict is not None and verdict.next_step is not None:
                # Let go of the run first, then enqueue its next step: whoever
                # takes that finds the lease free.
                held.lost = True  # released: nothing below may touch the run
                await store.release(held.lease)
                try:
                    await store.nudge(nudge.run_id, verdict.next_step)
                except RunStoreError as exc:  # not acked: the redelivery re-enqueues it
                    log.warning("run %s: next step not enqueued: %s", nudge.run_id, exc.message)
                    verdict = Verdict("nak", 1.0)
            if verdict is not None:
                if verdict.action == "ack":
                    self.crash.maybe("before_ack", nudge.run_id, nudge.step)
                await _settle_msg(msg, verdict)
                self.metrics.steps.labels(verdict.action).inc()
        finally:
            self.metrics.inflight.dec()
            self.metrics.step_duration.observe(time.monotonic() - started)
            if not held.lost:
                await store.release(held.lease)

    async def _step(self, msg: Msg, nudge: StepMsg, held: Held, delivery: int) -> Verdict | None:
        """The step under its lease and watchdog. None: leave the message alone
        (another executor owns the run now)."""
        store, stepper = self._store, self._stepper
        assert store is not None
        assert stepper is not None
        for _ in range(3):  # an interruption by a cancel notice re-checks the halts
            guard = Guard(nudge.run_id)
            self._guards[nudge.run_id] = guard
            work = asyncio.create_task(stepper.handle(nudge, guard))
            try:
                async with kept(store, msg, held, work, self.cfg.lease_s):
                    try:
                        done = await self._watch(work, guard)
                    except asyncio.CancelledError:  # draining past its grace: redelivered
                        await _effect_ended(guard)  # an effect in flight first records its outcome
                        await stop_task(work)
                        raise
            finally:
                self._guards.pop(nudge.run_id, None)
                self._adopt(guard)
            if not done:
                await stop_task(work)  # a dropped cancel would wait out the step
                if held.lost:
                    return None
                return await self._stuck(nudge, delivery)
            if held.lost or work.cancelled():
                self.metrics.steps.labels("conflict").inc()
                return None
            exc = work.exception()
            if exc is None:
                return work.result()
            if isinstance(exc, StepInterrupted):
                continue
            return await self._failed(nudge, exc, delivery)
        return Verdict("nak", 0.5)

    async def _watch(self, work: asyncio.Task[Verdict | None], guard: Guard) -> bool:
        """Whether the step ended before the watchdog: ``step_timeout_s`` of it
        with no effectful call in flight. An effect is never cut half-way (it is
        bounded by its tool's own timeout); the step gets a fresh window after it."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.cfg.step_timeout_s
        while True:
            done, _ = await asyncio.wait({work}, timeout=max(0.0, until - loop.time()))
            if done:
                return True
            effect = guard.effect
            if effect is None or effect.done():
                return False
            either: set[asyncio.Future[Any]] = {work, effect}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            until = loop.time() + self.cfg.step_timeout_s

    def _adopt(self, guard: Guard) -> None:
        """Own the effectful call a step left running, until it ends."""
        effect = guard.effect
        if effect is None or effect.done():
            return
        self._effects.add(effect)
        effect.add_done_callback(self._effect_done)

    def _effect_done(self, effect: asyncio.Future[Any]) -> None:
        self._effects.discard(effect)
        if not effect.cancelled() and (exc := effect.exception()) is not None:
            log.error("an effectful call left by its step failed", exc_info=exc)

    async def _stuck(self, nudge: StepMsg, delivery: int) -> Verdict:
        cfg = self.cfg
        self.metrics.steps.labels("stuck").inc()
        log.warning(
            "run %s: step %d stuck past %.1fs", nudge.run_id, nudge.step, cfg.step_timeout_s
        )
        if cfg.stuck_policy == "retry" and delivery <= cfg.stuck_retries:
            return Verdict("nak", 0.0)  # escalate: another executor takes it
        await self._fail_run(
            nudge, f"step {nudge.step} stuck: no outcome after {cfg.step_timeout_s:g}s"
        )
        return Verdict("ack")

    async def _failed(self, nudge: StepMsg, exc: BaseException, delivery: int) -> Verdict | None:
        if isinstance(exc, RunConflictError | LeaseLostError):
            self.metrics.steps.labels("conflict").inc()
            return None  # someone else wrote the run: it is theirs
        if isinstance(exc, RunTooLargeError):
            await self._fail_run(nudge, exc.message)
            return Verdict("ack")
        if isinstance(exc, EffectLedgerError | RunStoreError | nats.errors.Error | TimeoutError):
            # Infrastructure: nothing undurable was acked; try again shortly.
            log.warning("run %s: step %d: %s", nudge.run_id, nudge.step, exc)
            self.metrics.steps.labels("error").inc()
            return Verdict("nak", 1.0)
        log.error("run %s: step %d failed", nudge.run_id, nudge.step, exc_info=exc)
        self.metrics.steps.labels("error").inc()
        if delivery < _POISON_DELIVERIES:
            return Verdict("nak", 2.0)
        await self._fail_run(nudge, f"executor error: {type(exc).__name__}")
        return Verdict("ack")

    async def _fail_run(self, nudge: StepMsg, reason: str) -> None:
        store, stepper = self._store, self._stepper
        assert store is not None
        assert stepper is not None
        stored = await store.get(nudge.run_id)
        if stored is None or stored.run.terminal:
            return
        with contextlib.suppress(RunConflictError):
            await stepper.finish(RunHandle(store, stored), "failed", reason)


async def _settle_msg(msg: Msg, verdict: Verdict) -> None:
    with contextlib.suppress(nats.errors.Error):
        if verdict.action == "ack":
            await msg.ack()
        elif verdict.action == "term":
            await msg.term()
        else:
            await msg.nak(delay=verdict.delay or None)


async def _effect_ended(guard: Guard) -> None:
    """Wait for the effectful call in flight, if any, to record its outcome (the
    step is being cut: a drain past its grace). Cancelled again meanwhile, give up."""
    effect = guard.effect
    if effect is not None and not effect.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({effect})

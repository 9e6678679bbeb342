"""One step of one run: the state machine. The step message is only a nudge
("look at run R at step N"); the run record says what to do, so handling a
nudge twice, late, or after a crash always converges on the same run.

In order, for a nudge of run R at step N (the lease on R held by the caller):

1. no record yet -> try again shortly (the gateway enqueues before it writes);
2. repair: publish the events a crash may have lost;
3. terminal -> redo the terminal chores (idempotent) and ack; N older than the
   record's step -> re-enqueue the record's step (deduped) and ack;
4. halts, every step: a cancel of R or an ancestor -> ``cancelled``; the deadline
   passed -> ``deadline_exceeded``;
5. parked: ``awaiting_approval`` without a decision, ``awaiting_child`` whose
   child is still running -> the message goes back (nak) with a delay that
   ends at the run's deadline: it is the run's deadline timer, and a decision or
   a child's end nudges the run sooner under another message id;
6. the tool phase (calls of the last assistant turn without a tool message), or
   else the model phase (budget check -> model call -> assistant message).

Every outcome is written to the record (compare-and-set) before anything
depends on it; the caller acks the step message only after that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from nats.aio.client import Client

from streams.agent import (
    PARKED,
    SPAWN_TOOL,
    ModelCall,
    PendingApproval,
    Run,
    RunStatus,
    Spend,
    StepMsg,
    model_request_id,
)
from streams.agent_store import RunStore
from tools import NeedsApproval, Registry, Tier, ToolContext, ToolDispatcher, ToolResult
from workers.agent.config import ExecutorConfig
from workers.agent.crash import DELIVERY, STORED_AT, CrashPoints
from workers.agent.errors import ModelCallFailed, StepInterrupted
from workers.agent.guard import Guard
from workers.agent.handle import RunHandle, unanswered_calls
from workers.agent.metrics import AgentMetrics
from workers.agent.model import ModelClient, ModelReply
from workers.agent.spawn import Spawner

log = logging.getLogger(__name__)

Action = Literal["ack", "nak", "term"]

# Model-call failures before any engine saw the call: retried without spending
# an attempt, backing off, until the run's deadline.
NOT_ENQUEUED = frozenset({"bus_unavailable", "queue_full", "publish_failed"})
_ENQUEUE_BACKOFF_S = 0.25
_ENQUEUE_BACKOFF_MAX_S = 2.0
# A step for a run with no record yet waits this long (from when it was stored)
# for the gateway to write the record; past it, the create failed for good.
UNKNOWN_RUN_WAIT_S = 60.0


@dataclass(frozen=True)
class Verdict:
    action: Action
    delay: float = 0.0
    # The run's step to enqueue once its lease is given back (so the executor
    # that takes it does not find the lease still held).
    next_step: int | None = None


ACK = Verdict("ack")
# A model call older than this is re-issued under a new id: past the work
# queue's dedupe window a re-publish of the old id would run it a second time.
_DEDUPE_MARGIN_S = 15.0


class Stepper:
    def __init__(
        self,
        cfg: ExecutorConfig,
        store: RunStore,
        registry: Registry,
        dispatcher: ToolDispatcher,
        models: ModelClient,
        crash: CrashPoints,
        metrics: AgentMetrics,
        nc: Client,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.registry = registry
        self.dispatcher = dispatcher
        self.models = models
        self.crash = crash
        self.metrics = metrics
        self.nc = nc
        self.spawner = Spawner(store, registry.get(SPAWN_TOOL), cfg.max_depth)

    # -- entry ------------------------------------------------------------------

    async def handle(self, nudge: StepMsg, guard: Guard) -> Verdict:
        stored = await self.store.get(nudge.run_id)
        for _ in range(3):
            if stored is not None:
                break
            await asyncio.sleep(0.05)  # usually written a moment after the nudge
            stored = await self.store.get(nudge.run_id)
        if stored is None:
            # The gateway enqueues a run's first step before writing its record
            # (so no record is ever left without a step): wait for the record,
            # as long as a loaded gateway may take to write it. Counted in time,
            # not deliveries: a dropped nudge leaves its run queued for good.
            if time.time() - STORED_AT.get() < UNKNOWN_RUN_WAIT_S:
                return Verdict("nak", min(0.25 * DELIVERY.get(), 2.0))
            log.warning("step for unknown run %s dropped", nudge.run_id)
            return Verdict("term")
        h = RunHandle(self.store, stored)
        guard.bind(h.run)
        await h.publish_events()
        run = h.run
        if run.terminal:
            await self.after_terminal(h)
            return ACK
        if nudge.step < run.step:
            # A step already done (its ack was lost): make sure the current one
            # is queued, unless it is parked (a parked step keeps its own message).
            return ACK if run.status in PARKED else Verdict("ack", next_step=run.step)
        if nudge.step > run.step:
            log.warning("run %s: nudge for step %d ahead of %d", run.id, nudge.step, run.step)
            return ACK
        if await self.halted(h):
            return ACK
        if run.status == "queued":
            await h.save(status="running", step_started=time.time())
        elif run.status == "awaiting_child":
            resumed = await self.spawner.resume(h)
            if resumed is False:
                return park(h)
            if isinstance(resumed, Run):  # the child ended ambiguous: so does the parent
                reason = f"sub-agent {resumed.id} ambiguous: {resumed.reason}"
                changes = self.spawner.folded(run, resumed)
                changes["ambiguous_key"] = resumed.ambiguous_key
                await self.finish(h, "ambiguous", reason, **changes)
                return ACK
        elif run.status == "awaiting_approval":
            pending = run.pending_approval
            assert pending is not None
            if await self.store.decision(run.id, run.step, pending.call_id) is None:
                return park(h)
        return await self.advance(h, guard)

    async def halted(self, h: RunHandle) -> bool:
        """Cancel and deadline, checked every step (and after an interruption)."""
        run = h.run
        # The root first: a cancel high in the tree names where it came from,
        # whichever level noticed it first. Above the root, the API key that
        # started the tree: revoking it cancels every run it started.
        cancel = await self.store.cancel_request(halting_ids(run))
        if cancel is not None:
            who = "" if cancel.run_id in (run.id, run.key_id) else f" (run {cancel.run_id})"
            await self.finish(h, "cancelled", cancel.reason + who)
            return True
        if time.time() >= run.deadline:
            await self.finish(h, "deadline_exceeded", "the run's deadline passed")
            return True
        return False

    # -- phases -----------------------------------------------------------------

    async def advance(self, h: RunHandle, guard: Guard) -> Verdict:
        start = h.run.step
        while True:
            if guard.cancelled.is_set():
                # A cancel arrived during an effect (which is never cut short):
                # take it before anything else starts.
                raise StepInterrupted("a cancel of this run (or an ancestor) arrived")
            if h.run.step != start:
                # The step ended in the write that answered its last call: the
                # caller queues the next one, then acks this one.
                return Verdict("ack", next_step=h.run.step)
            calls = unanswered_calls(h.run.messages)
            if calls:
                # The stored cancel (and the deadline) before each call: a
                # cancel's notice is core NATS, and one this executor missed (a
                # reconnect) must not let the turn's effects go ahead.
                if await self.halted(h):
                    return ACK
                if not await self.tool_call(h, calls[0], guard):
                    return park(h) if h.run.status in PARKED else ACK
                continue
            halt = budget_halt(h)
            if halt:
                await self.finish(h, "budget_exceeded", halt)
                return ACK
            reply = await self.model_turn(h, guard)
            if reply is None:
                return ACK  # the run ended (failed, deadline)
            spent = h.run.spent.plus(
                Spend(
                    steps=1,
                    prompt_tokens=reply.usage.prompt_tokens,
                    completion_tokens=reply.usage.completion_tokens,
                    cached_tokens=reply.usage.cached_tokens,
                    cost_micros=h.run.price.cost(reply.usage),
                )
            )
            message = reply.message()
            self.metrics.model_calls.inc()
            self.metrics.tokens.labels("input").inc(reply.usage.prompt_tokens)
            self.metrics.tokens.labels("output").inc(reply.usage.completion_tokens)
            if reply.tool_calls:
                seen: set[str] = set()
                for i, call in enumerate(reply.tool_calls):
                    # None given, or one an earlier call of this turn has (some
                    # engines repeat ids): a stable one of its own. Two calls under
                    # one id would share a ledger key, and the second's answer
                    # would count as given once the first's is.
                    if not call.get("id") or call["id"] in seen:
                        made, n = f"call_{h.run.step}_{i}", 0
                        while made in seen or any(c.get("id") == made for c in reply.tool_calls):
                            n += 1  # the model's own ids may look like ours
                            made = f"call_{h.run.step}_{i}_{n}"
                        call["id"] = made
                    seen.add(call["id"])
                await h.save(messages=[*h.run.messages, message], spent=spent, model_call=None)
                continue
            await self.finish(
                h,
                "completed",
                "",
                messages=[*h.run.messages, message],
                spent=spent,
                result=reply.content or "",
            )
            return ACK

    async def model_turn(self, h: RunHandle, guard: Guard) -> ModelReply | None:
        run = h.run
        call = run.model_call
        now = time.time()
        fresh = (
            call is not None
            and call.step == run.step
            and now - call.started < self.cfg.agent.duplicate_window_s - _DEDUPE_MARGIN_S
        )
        if call is None or not fresh:
            attempt = call.attempt + 1 if call is not None and call.step == run.step else 1
            call = ModelCall(
                request_id=model_request_id(run.id, run.step, attempt),
                step=run.step,
                attempt=attempt,
                started=now,
            )
            # Recorded before it is published: a successor re-uses this id.
            await h.save(model_call=call, step_started=now)
        assert call is not None
        body = self.body(h)
        backoff = _ENQUEUE_BACKOFF_S
        while True:
            step = h.run.step

            def published(run_id: str = run.id, step: int = step) -> None:
                self.crash.maybe("model_call", run_id, step)

            try:
                return await guard.interruptible(self.models.call(h.run, call, body, published))
            except StepInterrupted:
                await self.models.cancel(call)
                raise
            except ModelCallFailed as exc:
                self.metrics.model_failures.labels(exc.code).inc()
                if exc.code == "deadline_exceeded" or (
                    exc.code in NOT_ENQUEUED and time.time() + backoff >= h.run.deadline
                ):
                    await self.finish(h, "deadline_exceeded", "the run's deadline passed")
                    return None
                if exc.code in NOT_ENQUEUED:
                    # The bus did not take the call (a leader election, a full
                    # queue): no engine saw it, so no attempt is spent. Wait and
                    # publish the same request id again (its Nats-Msg-Id dedupes
                    # a publish that landed unseen), up to the run's deadline.
                    log.info("run %s: model call not enqueued (%s); again", run.id, exc.code)
                    await guard.interruptible(asyncio.sleep(backoff))
                    backoff = min(backoff * 2, _ENQUEUE_BACKOFF_MAX_S)
                    continue
                if not exc.retryable or call.attempt >= self.cfg.model_attempts:
                    await self.finish(h, "failed", exc.message)
                    return None
                log.info("run %s: model call failed (%s); retrying", run.id, exc.code)
                call = ModelCall(
                    request_id=model_request_id(run.id, step, call.attempt + 1),
                    step=step,
                    attempt=call.attempt + 1,
                    started=time.time(),
                )
                await h.save(model_call=call)

    def body(self, h: RunHandle) -> dict[str, Any]:
        run = h.run
        left = run.remaining()
        body: dict[str, Any] = {
            "model": run.model,
            "messages": run.messages,
            "max_tokens": max(1, min(self.cfg.step_max_tokens, left.max_tokens)),
        }
        offered = [t for t in run.tools if t in self.registry]
        if offered:
            body["tools"] = self.registry.openai_tools(offered)
        return body

    async def tool_call(self, h: RunHandle, call: dict[str, Any], guard: Guard) -> bool:
        """Answer one call; False when the run parked or ended instead."""
        run = h.run
        call_id = str(call.get("id"))
        fn = call.get("function") or {}
        name = str(fn.get("name", ""))
        raw = fn.get("arguments", "")
        if not isinstance(raw, str):
            raw = "" if raw is None else str(raw)
        if name == SPAWN_TOOL:
            error = await self.spawner.spawn(h, call_id, raw)
            if error is None:
                return False
            await h.answer(call_id, name, error)
            return True
        ctx = ToolContext(
            run_id=run.id,
            step=run.step,
            call_id=call_id,
            traceparent=run.traceparent,
            deadline=run.deadline,
            tenant=run.tenant,
        )
        tool = self.registry.find(name)
        approved = False
        if tool is not None and tool.tier is Tier.REQUIRES_APPROVAL:
            decision = await self.store.decision(run.id, run.step, call_id)
            if decision is not None and not decision.approve:
                denied = NeedsApproval(call_id=call_id, tool=name, arguments={}, key=ctx.key)
                reason = "denied by the approver"
                if decision.reason:
                    reason += f": {decision.reason}"
                await h.answer(call_id, name, ToolDispatcher.denied(denied, reason).content())
                return True
            approved = decision is not None
        work = self.dispatcher.call(name, raw, ctx, run.tools, approved=approved)
        # Only waits without effects are interrupted; an effect runs to its outcome.
        if tool is not None and tool.tier is Tier.READ_ONLY:
            out = await guard.interruptible(work)
        else:
            out = await guard.effectful(work)
        if isinstance(out, NeedsApproval):
            pending = PendingApproval(
                call_id=out.call_id,
                tool=out.tool,
                arguments=out.arguments,
                key=out.key,
                description=out.description,
                asked_at=time.time(),
            )
            await h.save(status="awaiting_approval", pending_approval=pending)
            return False
        self.crash.maybe("after_outcome", run.id, run.step, call_id)
        return await self.record(h, out)

    async def record(self, h: RunHandle, out: ToolResult) -> bool:
        self.metrics.tool_results.labels(out.status).inc()
        if out.status == "ambiguous":
            # Never fed to the model as a failure, never run again: the run stops
            # and names the key an operator must settle.
            await self.finish(h, "ambiguous", out.error, ambiguous_key=out.key)
            return False
        await h.answer(out.call_id, out.tool, out.content())
        return True

    # -- the end ----------------------------------------------------------------

    async def finish(self, h: RunHandle, status: RunStatus, reason: str, **changes: Any) -> None:
        await h.save(
            status=status, reason=reason, model_call=None, pending_approval=None, **changes
        )
        self.metrics.runs.labels(status).inc()
        await self.after_terminal(h)

    async def after_terminal(self, h: RunHandle) -> None:
        """Chores of an ended run, idempotent (redone on every redelivery): stop
        children still running, wake the parent, or ask for the run's settlement."""
        run = h.run
        for child_id in run.children:
            child = await self.store.get(child_id)
            if child is not None and not child.run.terminal:
                await self.store.request_cancel(child_id, f"parent run {run.status}")
                await self.store.notify_cancel(child_id)
                await self.store.nudge(child_id, child.run.step, "cancel", suffix="cancel")
        if run.parent:
            await self.store.nudge(run.parent, run.parent_step, "child", suffix=f"child-{run.id}")
        else:
            if run.key_id:
                await self.store.unindex_run(run)
            await self.store.request_settle(run.id)


def halting_ids(run: Run) -> list[str]:
    """Whose recorded cancel stops ``run``, highest first: the API key that
    started its tree (revoked), its ancestors from the root, itself."""
    return [*([run.key_id] if run.key_id else []), *reversed(run.ancestors), run.id]


def park(h: RunHandle) -> Verdict:
    """A parked run's step message is not acked but handed back until the run's
    deadline: it is the run's deadline timer (a decision or a child's end
    nudges the run sooner, under another message id)."""
    return Verdict("nak", max(0.05, h.run.deadline - time.time() + 0.05))


def budget_halt(h: RunHandle) -> str:
    """Why the run may not make another model call ("" if it may)."""
    run = h.run
    left = run.remaining()
    if left.max_steps <= 0:
        return f"max_steps reached ({run.budget.max_steps})"
    if left.max_tokens <= 0:
        return f"max_tokens reached ({run.budget.max_tokens})"
    if left.max_cost_micros <= 0:
        return f"max_cost reached ({run.budget.max_cost_micros} micro-USD)"
    return ""

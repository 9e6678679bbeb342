"""The dispatcher: one tool call from a model, checked, gated, run, recorded.

``ToolDispatcher.call(name, raw_arguments, ctx, authority)``, in order:

1. unknown tool, or not in the run's authority -> ``{"error", "retryable": false}``;
2. arguments not JSON, not an object, or failing the tool's JSON Schema ->
   ``{"error": "invalid arguments: $.path: message; ...", "retryable": true}``
   (the model can fix them; the tool never sees them);
3. past the run's deadline -> ``{"error": "deadline exceeded", "retryable": false}``
   (unless the key already has a ledger entry: that answers);
4. tier ``requires_approval`` and not yet approved -> :class:`NeedsApproval`
   (nothing ran, nothing recorded);
5. read-only: run it under ``min(timeout_s, deadline - now)``; a timeout is
   ``{"error": "timeout", "retryable": true}``;
6. side-effecting (and approved): through the effect ledger (``tools.effects``)
   with ``ctx.key``: a first outcome is replayed, never re-run; a concurrent
   duplicate waits for the holder's outcome; an intent whose holder vanished is
   reconciled (``reconcile(key)``) or reported ``ambiguous``. A timeout or crash
   of the tool itself is ambiguous too: reconciled when the tool can, else
   ``status="ambiguous"``.

Every model-facing problem is a :class:`ToolResult`; the only exceptions that
escape are infrastructure ones (``EffectLedgerError``: the outcome is not durable, so
do not ack the step) and misconfiguration (``DispatchConfigError``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any

import msgspec
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, Counter, Histogram

from streams.logs import frames_of
from tools.arguments import parse_arguments
from tools.effects import Clock, Effect, EffectLedger
from tools.errors import (
    DispatchConfigError,
    EffectUnknownError,
    NotDeliveredError,
    ToolCallError,
    ToolCrashedError,
    ToolFailure,
    ToolTimeoutError,
)
from tools.registry import InProcess, Reconcile, Registry, Remote, Tier, Tool
from tools.remote import call_remote, reconcile_remote
from tools.results import ambiguous, bounded, from_effect, from_outcome, refuse, settled
from tools.wire import (
    NeedsApproval,
    Outcome,
    ToolContext,
    ToolResult,
    args_hash,
    to_json_value,
)

log = logging.getLogger(__name__)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ToolMetrics:
    """Tool outcomes, in the caller's registry (the executor serves it)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.calls = Counter(
            "jetserve_tool_calls",
            "Tool calls by outcome (status: ok, error, ambiguous, needs_approval; "
            "source: dispatcher, run, ledger, reconciled)",
            ["tool", "status", "source"],
            registry=r,
        )
        self.duration = Histogram(
            "jetserve_tool_duration_seconds",
            "Dispatch to result, per tool",
            ["tool"],
            buckets=_LATENCY,
            registry=r,
        )


class ToolDispatcher:
    """Runs tool calls for agent runs. ``ledger`` is required for side-effecting
    tools, ``nc`` for remote ones. ``lease_grace_s`` is added to a call's time
    budget for its ledger lease (time to record the outcome after the tool
    returns); ``poll_s`` is how often a duplicate caller re-reads the ledger."""

    def __init__(
        self,
        registry: Registry,
        *,
        ledger: EffectLedger | None = None,
        nc: Client | None = None,
        metrics: ToolMetrics | None = None,
        clock: Clock = time.time,
        lease_grace_s: float = 1.0,
        reconcile_timeout_s: float = 5.0,
        poll_s: float = 0.05,
    ) -> None:
        self.registry = registry
        self.ledger = ledger
        self.nc = nc
        self.metrics = metrics or ToolMetrics()
        self._clock = clock
        self._grace = lease_grace_s
        self._reconcile_timeout = reconcile_timeout_s
        self._poll = poll_s

    # -- entry point ----------------------------------------------------------

    async def call(
        self,
        name: str,
        raw_arguments: str,
        ctx: ToolContext,
        authority: Collection[str],
        *,
        approved: bool = False,
    ) -> ToolResult | NeedsApproval:
        """Dispatch one tool call the model made (see the module docstring)."""
        t0 = time.perf_counter()
        out = await self._call(name, raw_arguments, ctx, authority, approved)
        elapsed = time.perf_counter() - t0
        known = name in self.registry
        label = name if known else "_unknown"  # no label per model-invented name
        if isinstance(out, ToolResult):
            out = msgspec.structs.replace(out, duration_ms=round(elapsed * 1000, 3))
            self.metrics.calls.labels(label, out.status, out.source).inc()
        else:
            self.metrics.calls.labels(label, "needs_approval", "dispatcher").inc()
        if known:
            self.metrics.duration.labels(name).observe(elapsed)
        return out

    async def _call(
        self,
        name: str,
        raw_arguments: str,
        ctx: ToolContext,
        authority: Collection[str],
        approved: bool,
    ) -> ToolResult | NeedsApproval:
        tool = self.registry.find(name)
        if tool is None:
            return refuse(ctx, name, f"unknown tool: {name}")
        if name not in authority:
            return refuse(ctx, name, f"tool not permitted for this run: {name}")
        args_or_error = parse_arguments(tool, raw_arguments)
        if isinstance(args_or_error, str):
            return refuse(ctx, name, f"invalid arguments: {args_or_error}", retryable=True)
        args = args_or_error
        budget = self._budget(tool, ctx)
        if budget <= 0:
            # Too late to run anything; but an effect already attempted under this
            # key still has an answer (replayed, reconciled or ambiguous).
            if tool.effectful and self.ledger is not None:
                eff = await self.ledger.get(ctx.key)
                if eff is not None:
                    return await self._drive(tool, args, ctx, eff)
            return refuse(ctx, name, "deadline exceeded")
        if tool.tier is Tier.REQUIRES_APPROVAL and not approved:
            return NeedsApproval(
                call_id=ctx.call_id,
                tool=name,
                arguments=args,
                key=ctx.key,
                description=tool.description,
            )
        if not tool.effectful:
            return await self._read_only(tool, args, ctx, budget)
        return await self._effectful(tool, args, ctx, budget)

    @staticmethod
    def denied(request: NeedsApproval, reason: str = "denied by the approver") -> ToolResult:
        """The result to give the model when a human denies ``request``."""
        return ToolResult(
            call_id=request.call_id,
            tool=request.tool,
            status="error",
            error=reason,
            retryable=False,
            source="dispatcher",
            key=request.key,
        )

    def _budget(self, tool: Tool, ctx: ToolContext) -> float:
        if not ctx.deadline:
            return tool.timeout_s
        return min(tool.timeout_s, ctx.deadline - self._clock())

    # -- read-only ------------------------------------------------------------

    async def _read_only(
        self, tool: Tool, args: dict[str, Any], ctx: ToolContext, budget: float
    ) -> ToolResult:
        try:
            out = await self._invoke(tool, args, ctx, budget)
        except ToolTimeoutError:
            return from_outcome(ctx, tool.name, Outcome.failure("timeout", retryable=True))
        except ToolCallError as exc:
            return from_outcome(ctx, tool.name, Outcome.failure(exc.message, exc.retryable))
        return from_outcome(ctx, tool.name, out)

    # -- side-effecting -------------------------------------------------------

    async def _effectful(
        self, tool: Tool, args: dict[str, Any], ctx: ToolContext, budget: float
    ) -> ToolResult:
        ledger = self.ledger
        if ledger is None:
            raise DispatchConfigError(f"tool {tool.name} is side-effecting: no effect ledger")
        eff = await ledger.record_intent(
            ctx.key, tool.name, args_hash(args), lease_s=budget + self._grace
        )
        return await self._drive(tool, args, ctx, eff)

    async def _drive(
        self, tool: Tool, args: dict[str, Any], ctx: ToolContext, eff: Effect
    ) -> ToolResult:
        """From a ledger entry for ``ctx.key`` to a result: run it if ``eff`` is
        ours, replay a recorded outcome, wait for a live holder, reconcile or
        take over from a dead one, or report ``ambiguous``."""
        ledger = self.ledger
        assert ledger is not None
        key, digest = ctx.key, args_hash(args)
        budget = self._budget(tool, ctx)  # what the lease in a won entry was sized for
        for _ in range(16):  # each turn settles, or waits out a lease, or wins a write
            entry = eff.entry
            if entry.tool != tool.name or entry.args_hash != digest:
                return refuse(
                    ctx, tool.name, "idempotency key reused with different arguments or tool"
                )
            if eff.won:
                return await self._run_effect(tool, args, ctx, eff, max(budget, 0.001))
            if entry.state == "done":
                return settled(ctx, entry, "ledger")
            now = self._clock()
            if now < entry.lease_until:
                # Another caller holds the intent and may still be running it.
                until = entry.lease_until
                if ctx.deadline:
                    until = min(until, ctx.deadline)
                if now >= until:
                    return refuse(
                        ctx,
                        tool.name,
                        "in progress: a call with this key is running elsewhere",
                        retryable=True,
                    )
                changed = await self._await_change(key, eff, until)
                if changed is None:  # withdrawn (never delivered): the key is free again
                    budget = self._budget(tool, ctx)
                    if budget <= 0:
                        return refuse(ctx, tool.name, "deadline exceeded")
                    changed = await ledger.record_intent(
                        key, tool.name, digest, lease_s=budget + self._grace
                    )
                eff = changed
                continue
            # The holder is gone without an outcome: did the effect happen?
            reconcile = self._reconciler(tool)
            if reconcile is None:
                return ambiguous(ctx, tool.name, "no outcome recorded", "no_outcome")
            try:
                found = await self._ask(reconcile, key)
            except ToolCallError as exc:
                return ambiguous(ctx, tool.name, f"reconcile failed: {exc.message}", exc.code)
            if found is not None:
                eff = await ledger.record_outcome(key, found, eff.revision, settled_by="reconciled")
                if eff.won:
                    return settled(ctx, eff.entry, "reconciled")
                continue
            budget = self._budget(tool, ctx)
            if budget <= 0:
                return refuse(ctx, tool.name, "deadline exceeded")
            eff = await ledger.take_over(key, eff.revision, lease_s=budget + self._grace)
        return refuse(ctx, tool.name, "in progress: effect ledger contention", retryable=True)

    async def _run_effect(
        self, tool: Tool, args: dict[str, Any], ctx: ToolContext, eff: Effect, budget: float
    ) -> ToolResult:
        assert self.ledger is not None
        key = ctx.key
        try:
            out = await self._invoke(tool, args, ctx, budget)
        except NotDeliveredError as exc:
            # Certainly no effect: free the key so a retry may run it.
            await self.ledger.withdraw(key, eff.revision)
            return from_outcome(ctx, tool.name, Outcome.failure(exc.message, retryable=True))
        except EffectUnknownError as exc:
            reason = "timeout" if isinstance(exc, ToolTimeoutError) else exc.message
            reconcile = self._reconciler(tool)
            if reconcile is None:
                return ambiguous(ctx, tool.name, reason, exc.code)
            try:
                found = await self._ask(reconcile, key)
            except ToolCallError as rexc:
                return ambiguous(
                    ctx, tool.name, f"{reason}; reconcile failed: {rexc.message}", rexc.code
                )
            if found is None:
                # Not applied yet, but the call may still be running (a remote
                # tool goes on to the run's deadline) and land later. The model's
                # retry would be a new call under a new key, which this intent
                # cannot guard: as a failure the effect could happen twice. So it
                # is ambiguous; the intent stays, for a reconcile later.
                return ambiguous(
                    ctx, tool.name, f"{reason}; not applied yet, and may still be", exc.code
                )
            settled = await self.ledger.record_outcome(
                key, found, eff.revision, settled_by="reconciled"
            )
            return from_effect(ctx, tool.name, settled, "reconciled")
        settled = await self.ledger.record_outcome(key, out, eff.revision, settled_by="run")
        return from_effect(ctx, tool.name, settled, "run")

    async def _await_change(self, key: str, eff: Effect, until: float) -> Effect | None:
        """Re-read ``key`` until it changes or ``until`` (unix s) passes;
        None if the key is gone (its intent was withdrawn)."""
        assert self.ledger is not None
        delay = self._poll / 4
        while True:
            left = until - self._clock()
            if left <= 0:
                break
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, self._poll)
            now = await self.ledger.get(key)
            if now is None or now.revision != eff.revision:
                return now
        return await self.ledger.get(key)

    # -- running a tool -------------------------------------------------------

    def _reconciler(self, tool: Tool) -> Reconcile | None:
        if tool.reconcile is not None:
            return tool.reconcile
        runs = tool.runs
        if isinstance(runs, Remote) and runs.reconcile:
            nc = self._client(tool)
            timeout = self._reconcile_timeout

            async def remote(key: str) -> Outcome | None:
                return await reconcile_remote(nc, runs.subject, key, timeout)

            return remote
        return None

    async def _ask(self, reconcile: Reconcile, key: str) -> Outcome | None:
        """``reconcile(key)``; any failure to answer is a ToolCallError."""
        try:
            async with asyncio.timeout(self._reconcile_timeout):
                found = await reconcile(key)
        except ToolCallError:
            raise
        except TimeoutError:
            raise ToolTimeoutError("reconcile timeout") from None
        except Exception as exc:  # a reconciler that fails cannot tell
            raise EffectUnknownError(f"{type(exc).__name__}: {exc}") from exc
        if found is not None and not isinstance(found, Outcome):
            raise EffectUnknownError(f"reconcile returned {type(found).__name__}, not Outcome")
        return None if found is None else bounded(found)

    def _client(self, tool: Tool) -> Client:
        if self.nc is None:
            raise DispatchConfigError(f"tool {tool.name} is remote: no NATS client")
        return self.nc

    async def _invoke(
        self, tool: Tool, args: dict[str, Any], ctx: ToolContext, budget: float
    ) -> Outcome:
        """Run the tool once: an Outcome if it gave a definite answer, else a
        ToolCallError saying whether the effect is unknown or certainly absent."""
        runs = tool.runs
        if isinstance(runs, Remote):
            return bounded(await call_remote(self._client(tool), runs.subject, args, ctx, budget))
        assert isinstance(runs, InProcess)
        try:
            async with asyncio.timeout(budget) as cm:
                result = await runs.fn(args, ctx)
        except ToolFailure as f:
            return bounded(Outcome.failure(f.message, f.retryable))
        except TimeoutError as exc:
            if cm.expired():
                raise ToolTimeoutError("timeout") from None
            raise ToolCrashedError(f"TimeoutError: {exc}") from exc
        except Exception as exc:  # a crashed tool: effect unknown
            # Where, not what: its message may quote the call's arguments.
            log.warning("tool %s raised %s", tool.name, type(exc).__name__)
            log.debug("tool %s raised %s at\n%s", tool.name, type(exc).__name__, frames_of(exc))
            raise ToolCrashedError(f"tool failed: {type(exc).__name__}: {exc}") from exc
        try:
            return bounded(Outcome.success(to_json_value(result)))
        except (TypeError, msgspec.EncodeError) as exc:
            # It ran: this is its (final) outcome, not an unknown one.
            return Outcome.failure(f"tool returned a non-JSON result: {exc}")

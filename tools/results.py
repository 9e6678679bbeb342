"""The :class:`ToolResult` a dispatched call gives the model: a refusal, a tool's
outcome, a settled ledger entry, or an ambiguous effect."""

from __future__ import annotations

import logging

import msgspec

from tools.effects import Effect, kv_key
from tools.wire import (
    AMBIGUOUS_MESSAGE,
    EffectEntry,
    Outcome,
    ResultSource,
    ToolContext,
    ToolResult,
)

log = logging.getLogger(__name__)

# What one call's outcome may hold: it is recorded in the effect ledger and handed
# to the model in the run's record (1 MiB each, both).
MAX_RESULT_BYTES = 256 << 10
MAX_ERROR_CHARS = 4096
PREVIEW_BYTES = 4096


def bounded(outcome: Outcome) -> Outcome:
    """``outcome``, small enough to record. A result over MAX_RESULT_BYTES stays a
    success (the tool ran: as a failure a model may retry it into a second effect)
    holding a marker, its size and a preview; an error message is cut. Recorded
    whole, a side-effecting tool's large result was refused by the ledger at every
    redelivery and the run waited to its deadline with the effect done."""
    if not outcome.ok:
        if len(outcome.error) <= MAX_ERROR_CHARS:
            return outcome
        return Outcome.failure(outcome.error[:MAX_ERROR_CHARS] + " [truncated]", outcome.retryable)
    data = msgspec.json.encode(outcome.result)
    if len(data) <= MAX_RESULT_BYTES:
        return outcome
    preview = data[:PREVIEW_BYTES].decode("utf-8", errors="replace")
    return Outcome.success({"truncated": True, "bytes": len(data), "preview": preview})


def refuse(ctx: ToolContext, tool: str, error: str, *, retryable: bool = False) -> ToolResult:
    return ToolResult(
        call_id=ctx.call_id,
        tool=tool,
        status="error",
        error=error,
        retryable=retryable,
        source="dispatcher",
        key=ctx.key,
    )


def from_outcome(
    ctx: ToolContext, tool: str, out: Outcome, source: ResultSource = "run"
) -> ToolResult:
    return ToolResult(
        call_id=ctx.call_id,
        tool=tool,
        status="ok" if out.ok else "error",
        result=out.result if out.ok else None,
        error=out.error,
        retryable=out.retryable,
        source=source,
        key=ctx.key,
    )


def settled(ctx: ToolContext, entry: EffectEntry, source: ResultSource) -> ToolResult:
    assert entry.outcome is not None
    return from_outcome(ctx, entry.tool, entry.outcome, source)


def from_effect(ctx: ToolContext, tool: str, eff: Effect, source: ResultSource) -> ToolResult:
    """After our record_outcome: ours if it won, else whatever settled first."""
    if eff.entry.state == "done":
        return settled(ctx, eff.entry, source if eff.won else "ledger")
    # Our lease ran out and another caller took the key over: it will settle it.
    return refuse(
        ctx, tool, "in progress: a call with this key was taken over elsewhere", retryable=True
    )


def ambiguous(ctx: ToolContext, tool: str, reason: str, why: str) -> ToolResult:
    """``reason`` goes to the run (a tool's error text may quote its arguments,
    the model's output); the log gets ``why``, a fixed code."""
    log.warning("tool %s: ambiguous effect, %s (%s)", tool, kv_key(ctx.key), why)
    return ToolResult(
        call_id=ctx.call_id,
        tool=tool,
        status="ambiguous",
        error=f"{reason}: {AMBIGUOUS_MESSAGE}",
        retryable=False,
        source="dispatcher",
        key=ctx.key,
    )

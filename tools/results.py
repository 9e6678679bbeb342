"""The :class:`ToolResult` a dispatched call gives the model: a refusal, a tool's
outcome, a settled ledger entry, or an ambiguous effect."""

from __future__ import annotations

import logging

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


def ambiguous(ctx: ToolContext, tool: str, reason: str) -> ToolResult:
    log.warning("tool %s: ambiguous effect, %s (%s)", tool, kv_key(ctx.key), reason)
    return ToolResult(
        call_id=ctx.call_id,
        tool=tool,
        status="ambiguous",
        error=f"{reason}: {AMBIGUOUS_MESSAGE}",
        retryable=False,
        source="dispatcher",
        key=ctx.key,
    )

"""What the run API shows, whatever the protocol: a run's public shape and
the items of its event stream (``RunsService.events``)."""

from __future__ import annotations

from typing import Any

import msgspec

from streams.agent import Run


class RunEvent(msgspec.Struct, frozen=True):
    """One event of the run, as its executor published it."""

    seq: int  # its stream sequence: where a reader resumes (Last-Event-ID)
    kind: str
    data: bytes  # the event's JSON


class Idle(msgspec.Struct, frozen=True):
    """Nothing new for a keep-alive interval (a protocol may send a keep-alive)."""


class Ended(msgspec.Struct, frozen=True):
    """The run had ended before: nothing after the reader's resume point."""


RunStreamItem = RunEvent | Idle | Ended


def view(run: Run) -> dict[str, Any]:
    """The public shape of a run."""
    spent = run.spent.plus(run.children_spent)
    out: dict[str, Any] = {
        "id": run.id,
        "object": "agent.run",
        "status": run.status,
        "reason": run.reason or None,
        "result": run.result,
        "model": run.model,
        "tools": list(run.tools),
        "parent": run.parent or None,
        "root": run.root_id,
        "depth": run.depth,
        "children": list(run.children),
        "step": run.step,
        "budget": msgspec.to_builtins(run.budget),
        "usage": {
            "steps": spent.steps,
            "prompt_tokens": spent.prompt_tokens,
            "completion_tokens": spent.completion_tokens,
            "total_tokens": spent.tokens,
            "cost_micros": spent.cost_micros,
        },
        "remaining": msgspec.to_builtins(run.remaining()),
        "deadline": run.deadline,
        "created": run.created,
        "updated": run.updated,
        "pending_approval": msgspec.to_builtins(run.pending_approval)
        if run.pending_approval
        else None,
        # Who decided each gated call (key ids), in order: the audit trail.
        "approvals": [
            {
                "step": a.step,
                "call_id": a.call_id,
                "approve": a.approve,
                "reason": a.reason or None,
                "key_id": a.key_id,
                "at": a.at,
            }
            for a in run.approvals
        ],
        "ambiguous_key": run.ambiguous_key or None,
        "messages": run.messages,
        "traceparent": run.traceparent,
    }
    return out

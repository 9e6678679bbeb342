"""Sub-agents: the built-in ``spawn_agent`` tool.

A call starts a child run: its own id (derived from parent, step and call, so a
retry finds the same child), a budget carved from the parent's remainder in the
same compare-and-set write that parks the parent (so two spawns can never carve
the same remainder), a subset of the parent's tools (never a superset: asking
for more is refused), the parent's trace and deadline (or an earlier one).

The parent waits as ``awaiting_child``; the child, when it ends, nudges the
parent, whose next owner folds the child's result into the conversation (only
the result: never the child's messages) and its spend into ``children_spent``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from streams.agent import (
    SPAWN_TOOL,
    Budget,
    PendingChild,
    Run,
    RunStatus,
    child_run_id,
    child_traceparent,
)
from streams.agent_store import RunStore
from streams.errors import RunExistsError
from tools import InProcess, Tier, Tool, ToolContext, ToolFailure
from workers.agent.handle import RunHandle

SPAWN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "task": {"type": "string", "minLength": 1, "description": "what the sub-agent must do"},
        "tools": {
            "type": "array",
            "items": {"type": "string"},
            "uniqueItems": True,
            "description": "tools the sub-agent may use: a subset of yours",
        },
        "budget": {
            "type": "object",
            "properties": {
                "max_steps": {"type": "integer", "minimum": 1},
                "max_tokens": {"type": "integer", "minimum": 1},
                "max_cost_micros": {"type": "integer", "minimum": 0},
            },
            "additionalProperties": False,
        },
        "timeout_s": {"type": "number", "exclusiveMinimum": 0},
    },
    "required": ["task"],
    "additionalProperties": False,
}


async def _handled_by_the_executor(args: dict[str, Any], ctx: ToolContext) -> Any:
    raise ToolFailure("spawn_agent is run by the agent executor, not dispatched")


def spawn_tool() -> Tool:
    return Tool(
        SPAWN_TOOL,
        "Start a sub-agent on a task with a subset of your tools and part of your "
        "budget; its final answer comes back as this call's result.",
        SPAWN_SCHEMA,
        InProcess(_handled_by_the_executor),
        tier=Tier.READ_ONLY,
    )


def _error(message: str, retryable: bool = False) -> str:
    return msgspec.json.encode({"error": message, "retryable": retryable}).decode()


class Spawner:
    def __init__(self, store: RunStore, tool: Tool, max_depth: int) -> None:
        self.store = store
        self.tool = tool
        self.max_depth = max_depth

    async def spawn(self, h: RunHandle, call_id: str, raw: str) -> str | None:
        """Start the child and park the parent (None), or the error the model gets."""
        run = h.run
        if SPAWN_TOOL not in run.tools:
            return _error(f"tool not permitted for this run: {SPAWN_TOOL}")
        try:
            args = msgspec.json.decode(raw.strip() or "{}")
        except msgspec.DecodeError as exc:
            return _error(f"invalid arguments: not valid JSON ({exc})", retryable=True)
        if not isinstance(args, dict):
            return _error("invalid arguments: expected a JSON object", retryable=True)
        problems = self.tool.validation_errors(args)
        if problems:
            return _error(f"invalid arguments: {'; '.join(problems[:5])}", retryable=True)
        if run.depth + 1 > self.max_depth:
            return _error(f"denied: sub-agents nest at most {self.max_depth} deep")
        tools = tuple(dict.fromkeys(args.get("tools", [])))
        denied = [t for t in tools if t not in run.tools]
        if denied:
            return _error(
                f"denied: tools {denied} are not held by this run; "
                "a sub-agent gets a subset of its parent's tools"
            )
        left = run.remaining()
        asked = args.get("budget", {})
        budget = Budget(
            max_steps=asked.get("max_steps", max(1, left.max_steps // 2)),
            max_tokens=asked.get("max_tokens", left.max_tokens // 2),
            max_cost_micros=asked.get("max_cost_micros", left.max_cost_micros // 2),
        )
        if not budget.fits_in(left) or budget.max_steps < 1 or budget.max_tokens < 1:
            return _error(
                "denied: the budget asked for exceeds this run's remainder "
                f"(steps {left.max_steps}, tokens {left.max_tokens}, "
                f"cost {left.max_cost_micros} micro-USD)"
            )
        deadline = run.deadline
        if "timeout_s" in args:
            deadline = min(deadline, time.time() + float(args["timeout_s"]))
        pending = PendingChild(
            call_id=call_id,
            child_id=child_run_id(run.id, run.step, call_id),
            task=str(args["task"]),
            tools=tools,
            budget=budget,
            deadline=deadline,
        )
        # The carve: one compare-and-set on the parent's record.
        await h.save(
            status="awaiting_child",
            pending_child=pending,
            carved=run.carved.plus(budget),
            children=(*run.children, pending.child_id),
        )
        await self.ensure_child(h.run)
        return None

    async def ensure_child(self, parent: Run) -> None:
        """Create the pending child if a crash came between the carve and its
        creation, and make sure its current step is enqueued (both idempotent)."""
        p = parent.pending_child
        assert p is not None
        have = await self.store.get(p.child_id)
        if have is None:
            child = Run(
                id=p.child_id,
                tenant=parent.tenant,
                org=parent.org,
                key_id=parent.key_id,
                key_party=parent.key_party,
                model=parent.model,
                deadline=p.deadline,
                budget=p.budget,
                price=parent.price,
                parent=parent.id,
                root=parent.root_id,
                ancestors=(parent.id, *parent.ancestors),
                depth=parent.depth + 1,
                parent_step=parent.step,
                parent_call=p.call_id,
                plan_version=parent.plan_version,
                tools=p.tools,
                messages=[{"role": "user", "content": p.task}],
                traceparent=child_traceparent(parent.traceparent),
            )
            try:
                stored = await self.store.create(child)
                await self.store.publish_status(stored.run, stored.revision)
            except RunExistsError:
                pass
            await self.store.nudge(p.child_id, 0, "start")
        elif not have.run.terminal:
            await self.store.nudge(p.child_id, have.run.step, "start")

    async def resume(self, h: RunHandle) -> bool | Run:
        """The parent woke up: fold in a finished child (True), or keep waiting
        (False). A child that ended ``ambiguous`` is returned instead: its effect's
        outcome is unknown, so it is never fed to the parent's model as a failure
        (the model could do it again); the parent ends ambiguous too (:meth:`folded`)."""
        run = h.run
        p = run.pending_child
        assert p is not None
        have = await self.store.get(p.child_id)
        if have is None or not have.run.terminal:
            await self.ensure_child(run)
            return False
        child = have.run
        status: RunStatus = child.status
        if status == "ambiguous":
            return child
        if status == "completed":
            content = msgspec.json.encode({"result": child.result}).decode()
        else:
            content = _error(f"sub-agent {status}: {child.reason}")
        await h.answer(p.call_id, SPAWN_TOOL, content, **self.folded(run, child))
        return True

    @staticmethod
    def folded(run: Run, child: Run) -> dict[str, Any]:
        """The parent's changes for an ended child: its carve back, its spend added."""
        p = run.pending_child
        assert p is not None
        return {
            "pending_child": None,
            "carved": run.carved.minus(p.budget),
            "children_spent": run.children_spent.plus(child.spent.plus(child.children_spent)),
        }

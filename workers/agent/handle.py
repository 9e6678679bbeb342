"""The run being stepped: its record and the revision it was read at. Every
change goes through :meth:`RunHandle.save` (compare-and-set on that revision),
and each save is followed by the events it implies, so a reader of the events
never sees something that is not durable.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from streams.agent import Run, RunEvent
from streams.agent_store import RunStore, Stored


def unanswered_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls of the last assistant turn that have no tool message yet."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") != "assistant":
            continue
        # Ids as the answers carry them (str(), as the step reads a call's id): a
        # call whose raw id is not a string is still seen answered, never re-run.
        answered = {
            str(t.get("tool_call_id")) for t in messages[i + 1 :] if t.get("role") == "tool"
        }
        return [c for c in (m.get("tool_calls") or []) if str(c.get("id")) not in answered]
    return []


class RunHandle:
    def __init__(self, store: RunStore, stored: Stored) -> None:
        self.store = store
        self.run = stored.run
        self.revision = stored.revision

    async def save(self, **changes: Any) -> Run:
        """Persist ``changes`` (RunConflictError: the run moved on without us)."""
        old = self.run
        status = changes.get("status", old.status)
        if status != old.status:
            changes["status_seq"] = old.status_seq + 1
        changes.setdefault("events_through", len(old.messages))
        stored = await self.store.update(msgspec.structs.replace(old, **changes), self.revision)
        self.run, self.revision = stored.run, stored.revision
        await self._publish_messages()
        if self.run.status_seq != old.status_seq:
            await self.store.publish_status(self.run, self.revision)
        return self.run

    async def answer(self, call_id: str, name: str, content: str, **changes: Any) -> bool:
        """Append the tool message for ``call_id``; when it was the step's last open
        call, the step ends in the same write (so "all answered" and "next step"
        are never two states a crash could fall between). True when it ended."""
        msg = {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
        messages = [*self.run.messages, msg]
        done = not unanswered_calls(messages)
        if done:
            changes["step"] = self.run.step + 1
            changes.setdefault("step_started", 0.0)
        changes.setdefault("status", "running")
        changes.setdefault("pending_approval", None)
        await self.save(messages=messages, **changes)
        return done

    async def publish_events(self) -> None:
        """Repair after a crash: events for messages not yet announced, and the
        current status (both idempotent: ``Nats-Msg-Id`` per message index and
        per status change)."""
        await self._publish_messages()
        await self.store.publish_status(self.run, self.revision)

    async def _publish_messages(self) -> None:
        run = self.run
        now = time.time()
        for i in range(run.events_through, len(run.messages)):
            event = RunEvent(
                run_id=run.id,
                kind="message",
                status=run.status,
                step=run.step,
                at=now,
                revision=self.revision,
                index=i,
                message=run.messages[i],
            )
            await self.store.publish_event(run.tenant, event, f"{run.id}:m:{i}")

"""The run API's request bodies and their checks (whatever protocol brought them)."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec

from gateway.errors import BadRequest
from gateway.tenancy.limits import MAX_AMOUNT_MICROS
from streams.agent import Budget, RunPrice
from streams.wire import Usage

T = TypeVar("T")
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STEPS = 1000
MAX_TOKENS = 10_000_000


class BudgetIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_steps: int | None = None
    max_tokens: int | None = None
    max_cost: float | None = None  # USD
    max_cost_micros: int | None = None  # or integer micro-USD (wins)


class RunCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[dict[str, Any]]
    tools: list[str] = []
    budget: BudgetIn | None = None
    deadline: float | None = None  # absolute unix seconds
    timeout: float | None = None  # or seconds from now


class Decision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    approve: bool
    reason: str = ""


MAX_CALL_ID = 256


def check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise BadRequest("'messages' must not be empty.", param="messages")
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {sorted(_ROLES)}.")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string, a list or null.")
        if role == "tool" and not _is_call_id(m.get("tool_call_id")):
            raise BadRequest(
                f"messages[{i}].tool_call_id must be a string of 1 to {MAX_CALL_ID} characters.",
                param="messages",
            )
        if m.get("tool_calls") is not None:
            _check_calls(i, role, m["tool_calls"])


def _is_call_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_CALL_ID


def _check_calls(i: int, role: object, calls: object) -> None:
    """The tool calls of an assistant turn the client sends: the executor runs the
    unanswered ones of the last turn, and knows a call answered by its id. A call
    without one (or a number) was answered under another and ran again at every
    pass, the run record rewritten each time (4,000 messages in 20 s)."""
    if role != "assistant" or not isinstance(calls, list):
        raise BadRequest(
            f"messages[{i}].tool_calls must be a list, on an assistant message.", param="messages"
        )
    ids: set[str] = set()
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(c, dict) or not _is_call_id(c.get("id")):
            raise BadRequest(
                f"{where}.id must be a string of 1 to {MAX_CALL_ID} characters.", param="messages"
            )
        cid = c["id"]
        if cid in ids:
            raise BadRequest(f"{where}.id repeats another call's of the turn.", param="messages")
        ids.add(cid)
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.function.name must be a string.", param="messages")
        if not isinstance(fn.get("arguments", ""), str):
            raise BadRequest(f"{where}.function.arguments must be a JSON string.", param="messages")


def run_deadline(body: RunCreate, now: float, default_s: float, max_s: float) -> float:
    if body.deadline is not None and body.timeout is not None:
        raise BadRequest("Give 'deadline' or 'timeout', not both.", param="deadline")
    if body.deadline is not None:
        deadline = body.deadline
    else:
        deadline = now + (body.timeout if body.timeout is not None else default_s)
    if not now < deadline <= now + max_s:
        raise BadRequest(
            f"The deadline must be in the future and at most {max_s:g}s away.", param="deadline"
        )
    return deadline


def run_budget(asked: BudgetIn | None, price: RunPrice) -> Budget:
    asked = asked or BudgetIn()
    steps = asked.max_steps if asked.max_steps is not None else Budget().max_steps
    tokens = asked.max_tokens if asked.max_tokens is not None else Budget().max_tokens
    if not 1 <= steps <= MAX_STEPS:
        raise BadRequest(f"budget.max_steps must be in [1, {MAX_STEPS}].", param="budget")
    if not 1 <= tokens <= MAX_TOKENS:
        raise BadRequest(f"budget.max_tokens must be in [1, {MAX_TOKENS}].", param="budget")
    if asked.max_cost_micros is not None:
        cost = asked.max_cost_micros
    elif asked.max_cost is not None:
        if not math.isfinite(asked.max_cost):
            raise BadRequest("budget.max_cost must be a finite number.", param="budget")
        cost = round(asked.max_cost * 1_000_000)
    else:
        # Default: every token at the output price, the most the tokens can cost.
        cost = price.cost(Usage(prompt_tokens=0, completion_tokens=tokens))
    if cost < 1:
        raise BadRequest("budget.max_cost must be positive.", param="budget")
    if cost > MAX_AMOUNT_MICROS:
        # Held at every level of the org: an amount near Redis's 64-bit limit made
        # every later hold of the org overflow (503 for all its tenants).
        raise BadRequest(
            f"budget.max_cost must be at most {MAX_AMOUNT_MICROS // 1_000_000} USD.",
            param="budget",
        )
    return Budget(max_steps=steps, max_tokens=tokens, max_cost_micros=cost)

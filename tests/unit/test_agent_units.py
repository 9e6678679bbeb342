"""Agent runs without a server: wire codecs, budget arithmetic, prices, ids, the
crash-point draw, tool-call bookkeeping, the spawn refusals, the API's checks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from gateway.errors import BadRequest
from gateway.runs.bodies import BudgetIn, RunCreate, run_budget, run_deadline
from gateway.tenancy.pricing import Price
from streams.agent import (
    NO_BUDGET,
    SPAWN_TOOL,
    Budget,
    Run,
    RunEvent,
    RunPrice,
    Spend,
    StepMsg,
    child_run_id,
    child_traceparent,
    decode_event,
    decode_run,
    decode_step,
    encode,
    is_run_id,
    run_id_for,
    step_msg_id,
    token,
)
from streams.agent_store import Stored, approval_key
from streams.inference.tool_calls import ToolCalls
from streams.wire import Usage
from workers.agent.crash import POINTS, CrashPoints, parse_crash_specs
from workers.agent.errors import CrashSpecError
from workers.agent.handle import RunHandle, unanswered_calls
from workers.agent.model import ModelReply
from workers.agent.spawn import Spawner, spawn_tool
from workers.agent.step import budget_halt


def make_run(**kw: Any) -> Run:
    base: dict[str, Any] = {
        "id": "run_abc",
        "tenant": "t",
        "model": "sim-8b",
        "deadline": time.time() + 60,
        "budget": Budget(max_steps=10, max_tokens=1000, max_cost_micros=500),
        "tools": ("balance", SPAWN_TOOL),
    }
    return Run(**{**base, **kw})


# -- wire ------------------------------------------------------------------------------


def test_run_round_trips_and_old_records_decode() -> None:
    run = make_run(
        messages=[{"role": "user", "content": "hi"}],
        spent=Spend(steps=1, prompt_tokens=10, completion_tokens=5, cost_micros=3),
    )
    assert decode_run(encode(run)) == run
    assert json.loads(encode(run))["type"] == "run"
    # A record written before a field existed still decodes (defaults).
    minimal = {"type": "run", "id": "run_x", "tenant": "t", "model": "m", "deadline": 1.0}
    minimal["budget"] = {"max_steps": 1}
    assert decode_run(json.dumps(minimal).encode()).status == "queued"
    assert decode_step(encode(StepMsg("run_x", 3))) == StepMsg("run_x", 3)
    event = RunEvent(run_id="run_x", kind="status", status="running", step=0, at=1.0)
    assert decode_event(encode(event)) == event


def test_ids_are_safe_tokens_and_deterministic_where_they_must_be() -> None:
    assert child_run_id("run_a", 2, "call_1") == child_run_id("run_a", 2, "call_1")
    assert child_run_id("run_a", 2, "call_1") != child_run_id("run_a", 3, "call_1")
    assert run_id_for("t", "k") == run_id_for("t", "k") != run_id_for("u", "k")
    assert is_run_id(run_id_for("t", "k"))
    assert not is_run_id("run.x")
    assert token("call_1") == "call_1"
    assert token("call 1.*>") != "call 1.*>"
    assert token("call 1.*>").isalnum()
    # One to one: a safe id shaped like another id's digest is digested too.
    assert token(token("x.y")) != token("x.y")
    assert approval_key("run_a", 2, "call_1") == "run_a.approval.2.call_1"
    assert step_msg_id("run_a", 2) == "run_a:2"
    assert step_msg_id("run_a", 2, "x") == "run_a:2:x"


def test_child_traceparent_stays_in_the_trace() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    child = child_traceparent(parent)
    assert child.split("-")[1] == parent.split("-")[1]
    assert child.split("-")[2] != parent.split("-")[2]
    assert len(child_traceparent("").split("-")[1]) == 32


# -- budgets and prices --------------------------------------------------------------


def test_remaining_counts_own_spend_finished_children_and_live_carves() -> None:
    run = make_run(
        spent=Spend(steps=2, prompt_tokens=100, completion_tokens=50, cost_micros=40),
        children_spent=Spend(steps=1, prompt_tokens=10, completion_tokens=10, cost_micros=10),
        carved=Budget(max_steps=3, max_tokens=200, max_cost_micros=100),
    )
    assert run.remaining() == Budget(max_steps=4, max_tokens=630, max_cost_micros=350)
    assert Budget(max_steps=4, max_tokens=1, max_cost_micros=1).fits_in(run.remaining())
    assert not Budget(max_steps=5, max_tokens=1, max_cost_micros=1).fits_in(run.remaining())
    assert NO_BUDGET.plus(run.budget).minus(run.budget) == NO_BUDGET


@pytest.mark.parametrize(
    ("spent", "reason"),
    [
        (Spend(), ""),
        (Spend(steps=10), "max_steps reached (10)"),
        (Spend(steps=1, prompt_tokens=1000), "max_tokens reached (1000)"),
        (Spend(steps=1, cost_micros=500), "max_cost reached (500 micro-USD)"),
    ],
)
def test_budget_halts(spent: Spend, reason: str) -> None:
    handle = RunHandle(cast(Any, None), Stored(make_run(spent=spent), 1))
    assert budget_halt(handle) == reason


@pytest.mark.parametrize(
    "usage",
    [Usage(0, 0), Usage(1, 0), Usage(999, 1), Usage(1234, 567, 200), Usage(10, 10, 50)],
)
def test_run_price_is_the_gateway_price(usage: Usage) -> None:
    for cached in (None, 25):
        gw = Price(input_per_1k=150, output_per_1k=600, cached_per_1k=cached)
        run = RunPrice(input_per_1k=150, output_per_1k=600, cached_per_1k=cached)
        assert run.cost(usage) == gw.cost(usage)


# -- the API's checks ------------------------------------------------------------------


def test_budget_defaults_and_bounds() -> None:
    price = RunPrice(input_per_1k=100, output_per_1k=300)
    default = run_budget(None, price)
    assert default.max_steps == 16
    assert default.max_cost_micros == 32_000 * 300 // 1000
    assert run_budget(BudgetIn(max_cost=0.5), price).max_cost_micros == 500_000
    assert run_budget(BudgetIn(max_cost=1.0, max_cost_micros=7), price).max_cost_micros == 7
    for bad in (BudgetIn(max_steps=0), BudgetIn(max_tokens=0), BudgetIn(max_cost_micros=0)):
        with pytest.raises(BadRequest):
            run_budget(bad, price)


def test_deadline_is_absolute_bounded_and_not_both() -> None:
    now = 1000.0
    assert run_deadline(RunCreate(model="m", messages=[]), now, 600, 3600) == 1600
    assert run_deadline(RunCreate(model="m", messages=[], timeout=5), now, 600, 3600) == 1005
    assert run_deadline(RunCreate(model="m", messages=[], deadline=2000), now, 600, 3600) == 2000
    for body in (
        RunCreate(model="m", messages=[], deadline=999),
        RunCreate(model="m", messages=[], timeout=4000),
        RunCreate(model="m", messages=[], timeout=5, deadline=1100),
    ):
        with pytest.raises(BadRequest):
            run_deadline(body, now, 600, 3600)


# -- crash points ------------------------------------------------------------------------


def test_crash_specs_parse_and_refuse_nonsense() -> None:
    assert parse_crash_specs(["after_intent:0.5", "model_call:1"]) == {
        "after_intent": 0.5,
        "model_call": 1.0,
    }
    for bad in ("nowhere:0.5", "after_intent", "after_intent:x", "after_intent:1.5"):
        with pytest.raises(CrashSpecError):
            parse_crash_specs([bad])


def test_crash_draw_is_reproducible_and_near_its_probability() -> None:
    points = CrashPoints(dict.fromkeys(POINTS, 0.1))
    draws = [points.draw("after_effect", f"run_{i}", 0, "call_1") for i in range(5000)]
    assert draws == [points.draw("after_effect", f"run_{i}", 0, "call_1") for i in range(5000)]
    assert 400 < sum(draws) < 600
    assert not CrashPoints({}).draw("after_effect", "run_1", 0)


def test_a_logged_crash_does_not_fire_again(tmp_path: Path) -> None:
    log = tmp_path / "crashes.jsonl"
    points = CrashPoints({"before_ack": 1.0}, str(log))
    assert points.hits("before_ack", "run_1", 0)
    record = {"point": "before_ack", "run": "run_1", "step": 0, "call": ""}
    log.write_text(json.dumps(record) + "\n{torn line")
    assert not points.hits("before_ack", "run_1", 0)
    assert points.hits("before_ack", "run_1", 1)


# -- tool calls --------------------------------------------------------------------------


def test_unanswered_calls_are_those_of_the_last_assistant_turn() -> None:
    c1 = {"id": "a", "function": {"name": "x", "arguments": "{}"}}
    c2 = {"id": "b", "function": {"name": "y", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    assert unanswered_calls(messages) == []
    messages.append({"role": "assistant", "content": None, "tool_calls": [c1, c2]})
    assert unanswered_calls(messages) == [c1, c2]
    messages.append({"role": "tool", "tool_call_id": "a", "content": "1"})
    assert unanswered_calls(messages) == [c2]
    messages.append({"role": "tool", "tool_call_id": "b", "content": "2"})
    assert unanswered_calls(messages) == []
    messages.append({"role": "assistant", "content": "done"})
    assert unanswered_calls(messages) == []


def test_a_call_whose_raw_id_is_not_a_string_is_seen_answered() -> None:
    """The step answers a call under str(id): a record from before the gateway
    checked client calls (an id missing, or a number) must not loop."""
    for raw in (None, 5):
        call: dict[str, Any] = {"function": {"name": "x", "arguments": "{}"}}
        if raw is not None:
            call["id"] = raw
        messages: list[dict[str, Any]] = [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": str(raw), "content": "1"},
        ]
        assert unanswered_calls(messages) == [], raw


def test_streamed_tool_call_deltas_merge_into_whole_calls() -> None:
    acc = ToolCalls()
    fn0 = {"name": "transfer", "arguments": ""}
    acc.add([{"index": 0, "id": "call_1", "type": "function", "function": fn0}])
    acc.add([{"index": 0, "function": {"arguments": '{"amount": '}}])
    acc.add([{"index": 1, "id": "call_2", "function": {"name": "balance"}}])
    acc.add([{"index": 0, "function": {"arguments": "5}"}}])
    acc.add([{"index": 1, "function": {"arguments": {"account": "a"}}}])
    first, second = acc.merged()
    assert first["function"] == {"name": "transfer", "arguments": '{"amount": 5}'}
    assert second["id"] == "call_2"
    assert json.loads(second["function"]["arguments"]) == {"account": "a"}
    reply = ModelReply(None, [first], "tool_calls", Usage())
    assert reply.message() == {"role": "assistant", "content": None, "tool_calls": [first]}


# -- spawn refusals (nothing is written for them) ------------------------------------------


@pytest.mark.parametrize(
    ("args", "run_kw", "error"),
    [
        ({"task": "x", "tools": ["transfer"]}, {}, "denied: tools ['transfer'] are not held"),
        ({"task": ""}, {}, "invalid arguments: $.task"),
        ({"task": "x", "extra": 1}, {}, "invalid arguments"),
        ({"task": "x", "budget": {"max_steps": 11}}, {}, "denied: the budget asked for exceeds"),
        ({"task": "x", "budget": {"max_cost_micros": 501}}, {}, "denied: the budget asked"),
        ({"task": "x"}, {"depth": 3}, "denied: sub-agents nest at most 3 deep"),
        ({"task": "x"}, {"tools": ("balance",)}, "tool not permitted for this run: spawn_agent"),
    ],
)
async def test_spawn_refusals(args: dict[str, Any], run_kw: dict[str, Any], error: str) -> None:
    spawner = Spawner(cast(Any, None), spawn_tool(), max_depth=3)
    handle = RunHandle(cast(Any, None), Stored(make_run(**run_kw), 1))
    out = await spawner.spawn(handle, "call_1", json.dumps(args))
    assert out is not None
    content = msgspec.json.decode(out)
    assert content["error"].startswith(error), content

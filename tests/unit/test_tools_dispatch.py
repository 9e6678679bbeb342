"""The tool registry and the dispatcher's checks, without NATS: definitions,
OpenAI specs, schema errors, authority, approval, read-only timeouts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from tools import (
    DispatchConfigError,
    DuplicateToolError,
    InProcess,
    NeedsApproval,
    Registry,
    Remote,
    Tier,
    Tool,
    ToolContext,
    ToolDefinitionError,
    ToolDispatcher,
    ToolFailure,
    ToolResult,
    UnknownToolError,
    idempotency_key,
)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["c", "f"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}

TRANSFER_SCHEMA = {
    "type": "object",
    "properties": {
        "from": {"type": "string"},
        "to": {"type": "string"},
        "amount": {"type": "integer", "exclusiveMinimum": 0},
    },
    "required": ["from", "to", "amount"],
}


async def weather(args: dict[str, Any], ctx: ToolContext) -> Any:
    return {"city": args["city"], "temp": 21, "key": ctx.key}


async def slow(args: dict[str, Any], ctx: ToolContext) -> Any:
    await asyncio.Event().wait()  # never answers: only a timeout ends the call
    return "late"


async def picky(args: dict[str, Any], ctx: ToolContext) -> Any:
    raise ToolFailure("city not found", retryable=False)


async def broken(args: dict[str, Any], ctx: ToolContext) -> Any:
    raise RuntimeError("boom")


async def never(args: dict[str, Any], ctx: ToolContext) -> Any:
    raise AssertionError("must not run")


def registry() -> Registry:
    return Registry(
        [
            Tool("weather", "Weather forecast for a city", WEATHER_SCHEMA, InProcess(weather)),
            Tool("slow", "Hangs", {"type": "object"}, InProcess(slow), timeout_s=0.1),
            # Its own timeout outlasts the tests' hang guards: only a deadline ends it.
            Tool("slower", "Hangs", {"type": "object"}, InProcess(slow), timeout_s=30),
            Tool("picky", "Fails", {"type": "object"}, InProcess(picky)),
            Tool("broken", "Crashes", {"type": "object"}, InProcess(broken)),
            Tool(
                "wire_money",
                "Send money (a human approves)",
                TRANSFER_SCHEMA,
                InProcess(never),
                tier=Tier.REQUIRES_APPROVAL,
            ),
            Tool("guarded", "Never runs", WEATHER_SCHEMA, InProcess(never)),
        ]
    )


ALL = {"weather", "slow", "slower", "picky", "broken", "wire_money", "guarded"}


def ctx(**kw: Any) -> ToolContext:
    return ToolContext(run_id="run1", step=3, call_id="call_a", **kw)


# -- definitions -------------------------------------------------------------


def test_invalid_schema_fails_at_registration() -> None:
    with pytest.raises(ToolDefinitionError, match="invalid JSON Schema"):
        Tool(
            "t", "d", {"type": "object", "properties": {"x": {"type": "nope"}}}, InProcess(weather)
        )
    with pytest.raises(ToolDefinitionError, match='"type": "object"'):
        Tool("t", "d", {"type": "array"}, InProcess(weather))
    with pytest.raises(ToolDefinitionError, match="invalid tool name"):
        Tool("has space", "d", {"type": "object"}, InProcess(weather))
    with pytest.raises(ToolDefinitionError, match="timeout_s"):
        Tool("t", "d", {"type": "object"}, InProcess(weather), timeout_s=0)
    with pytest.raises(ToolDefinitionError, match="subject"):
        Remote("tools.*")


def test_registry_register_get_list_and_openai_specs() -> None:
    reg = registry()
    assert [t.name for t in reg.list()][:2] == ["broken", "guarded"]
    assert reg.get("weather").tier is Tier.READ_ONLY
    with pytest.raises(UnknownToolError, match="unknown tool: nope"):
        reg.get("nope")
    same = reg.get("weather")
    reg.register(same)  # the same definition again: fine
    with pytest.raises(DuplicateToolError):
        reg.register(Tool("weather", "other", {"type": "object"}, InProcess(weather)))
    specs = reg.openai_tools(["weather", "wire_money"])
    assert specs[0] == {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER_SCHEMA,
        },
    }
    assert [s["function"]["name"] for s in specs] == ["weather", "wire_money"]
    msgspec.json.encode(specs)  # serialisable as is
    with pytest.raises(UnknownToolError):
        reg.openai_tools(["weather", "nope"])


def test_context_key_is_run_step_call_and_round_trips() -> None:
    c = ctx(traceparent="00-ab-cd-01", deadline=12.5)
    assert c.key == idempotency_key("run1", 3, "call_a") == "run1/3/call_a"
    assert msgspec.json.decode(msgspec.json.encode(c), type=ToolContext) == c


# -- dispatch checks ---------------------------------------------------------


async def test_schema_errors_are_structured_and_readable() -> None:
    d = ToolDispatcher(registry())
    r = await d.call("weather", '{"city": "", "days": 9, "extra": 1}', ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert r.status == "error"
    assert r.retryable
    assert r.source == "dispatcher"
    assert r.error.startswith("invalid arguments: ")
    assert "$: Additional properties are not allowed ('extra' was unexpected)" in r.error
    assert "$.city: '' should be non-empty" in r.error
    assert "$.days: 9 is greater than the maximum of 7" in r.error
    assert msgspec.json.decode(r.content()) == {"error": r.error, "retryable": True}

    r = await d.call("weather", "{}", ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert r.error == "invalid arguments: $: 'city' is a required property"

    r = await d.call("weather", '{"city": "Oslo",', ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert r.error.startswith("invalid arguments: not valid JSON")
    assert r.retryable

    r = await d.call("weather", '["Oslo"]', ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert r.error == "invalid arguments: expected a JSON object, got array"


async def test_invalid_arguments_never_reach_the_tool() -> None:
    d = ToolDispatcher(registry())
    r = await d.call("guarded", '{"city": 5}', ctx(), ALL)  # `never` would raise
    assert isinstance(r, ToolResult)
    assert r.error == "invalid arguments: $.city: 5 is not of type 'string'"


async def test_valid_call_runs_and_content_is_the_result() -> None:
    d = ToolDispatcher(registry())
    r = await d.call("weather", '{"city": "Oslo"}', ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert r.ok
    assert r.source == "run"
    assert r.key == "run1/3/call_a"
    assert r.result == {"city": "Oslo", "temp": 21, "key": "run1/3/call_a"}
    assert msgspec.json.decode(r.content()) == r.result


async def test_unknown_or_unauthorised_tools_are_refused() -> None:
    d = ToolDispatcher(registry())
    r = await d.call("rm_rf", "{}", ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert (r.status, r.error, r.retryable) == ("error", "unknown tool: rm_rf", False)
    r = await d.call("guarded", '{"city": "Oslo"}', ctx(), {"weather"})
    assert isinstance(r, ToolResult)
    assert r.error == "tool not permitted for this run: guarded"
    assert not r.retryable
    assert msgspec.json.decode(r.content()) == {"error": r.error, "retryable": False}


async def test_approval_tier_pauses_without_running() -> None:
    d = ToolDispatcher(registry())
    r = await d.call("wire_money", '{"from": "a", "to": "b", "amount": 5}', ctx(), ALL)
    assert isinstance(r, NeedsApproval)
    assert r.arguments == {"from": "a", "to": "b", "amount": 5}
    assert (r.tool, r.call_id, r.key) == ("wire_money", "call_a", "run1/3/call_a")
    # Validation comes first: a bad call is not put in front of a human.
    bad = await d.call("wire_money", '{"from": "a", "to": "b", "amount": 0}', ctx(), ALL)
    assert isinstance(bad, ToolResult)
    assert bad.error.startswith("invalid arguments")
    # Approved, it is side-effecting: it needs the effect ledger.
    with pytest.raises(DispatchConfigError):
        await d.call(
            "wire_money", '{"from": "a", "to": "b", "amount": 5}', ctx(), ALL, approved=True
        )


async def test_read_only_timeout_failure_crash_and_deadline() -> None:
    d = ToolDispatcher(registry())
    async with asyncio.timeout(10):  # a hang guard: the tool never answers
        r = await d.call("slow", "", ctx(), ALL)  # "" means no arguments
    assert isinstance(r, ToolResult)
    assert (r.status, r.error, r.retryable) == ("error", "timeout", True)
    assert msgspec.json.decode(r.content()) == {"error": "timeout", "retryable": True}

    r = await d.call("picky", "{}", ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert (r.status, r.error, r.retryable, r.source) == ("error", "city not found", False, "run")

    r = await d.call("broken", "{}", ctx(), ALL)
    assert isinstance(r, ToolResult)
    assert r.error == "tool failed: RuntimeError: boom"
    assert not r.retryable

    r = await d.call("weather", '{"city": "Oslo"}', ctx(deadline=time.time() - 1), ALL)
    assert isinstance(r, ToolResult)
    assert (r.error, r.retryable) == ("deadline exceeded", False)

    # The run's deadline caps the tool's own timeout: "slower" would hang for
    # 30 s, past this guard, so returning at all shows the deadline ended it.
    async with asyncio.timeout(10):
        r = await d.call("slower", "{}", ctx(deadline=time.time() + 0.05), ALL)
    assert isinstance(r, ToolResult)
    assert r.error == "timeout"


async def test_metrics_count_outcomes() -> None:
    d = ToolDispatcher(registry())
    await d.call("weather", '{"city": "Oslo"}', ctx(), ALL)
    await d.call("nope", "{}", ctx(), ALL)
    reg = d.metrics.registry
    ok = {"tool": "weather", "status": "ok", "source": "run"}
    assert reg.get_sample_value("jetserve_tool_calls_total", ok) == 1
    refused = {"tool": "_unknown", "status": "error", "source": "dispatcher"}
    assert reg.get_sample_value("jetserve_tool_calls_total", refused) == 1

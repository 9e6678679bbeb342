"""Scripted responses: tool calls streamed and non-streamed, rule matching, overrides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.sim.simkit import SimHandle, StartSim, chat_body, sse

TRANSFER = {
    "match": {"last_user": r"(?i)send \d+"},
    "response": {
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "transfer", "arguments": '{"amount": 100, "to": "bob"}'},
            }
        ]
    },
}
AFTER_TOOL = {"match": {"last_role": "tool"}, "response": {"content": "Done: sent 100 to bob."}}


async def _load(h: SimHandle, rules: list[dict[str, Any]], append: bool = False) -> None:
    r = await h.client.post("/sim/scripts" + ("?append=1" if append else ""), json=rules)
    assert r.status_code == 200


async def test_scripted_tool_call_non_stream(fast: SimHandle) -> None:
    await _load(fast, [TRANSFER, AFTER_TOOL])
    r = (await fast.client.post("/v1/chat/completions", json=chat_body("Send 100 to bob"))).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "call_1"
    assert call["type"] == "function"
    assert call["function"]["name"] == "transfer"
    assert json.loads(call["function"]["arguments"]) == {"amount": 100, "to": "bob"}
    # The next turn (a tool result) matches the second rule.
    messages = [
        {"role": "user", "content": "Send 100 to bob"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
    ]
    r2 = (await fast.client.post("/v1/chat/completions", json={"messages": messages})).json()
    assert r2["choices"][0]["message"]["content"] == "Done: sent 100 to bob."
    assert r2["choices"][0]["finish_reason"] == "stop"
    assert r2["usage"]["completion_tokens"] == 7  # Done : sent 100 to bob .


async def test_scripted_tool_call_stream(fast: SimHandle) -> None:
    await _load(fast, [TRANSFER])
    body = chat_body("please send 100 now", stream=True, stream_options={"include_usage": True})
    s = await sse(fast.client, "/v1/chat/completions", body)
    assert s.done
    role, *deltas, usage = s.events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    calls = [d["choices"][0]["delta"]["tool_calls"][0] for d in deltas]
    head = calls[0]
    assert head == {
        "index": 0, "id": "call_1", "type": "function",
        "function": {"name": "transfer", "arguments": ""},
    }  # fmt: skip
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in calls[1:])
    args = "".join(c["function"]["arguments"] for c in calls[1:])
    assert args == '{"amount": 100, "to": "bob"}'
    assert [d["choices"][0]["finish_reason"] for d in deltas] == [None] * (len(deltas) - 1) + [
        "tool_calls"
    ]
    assert usage["usage"]["completion_tokens"] == len(deltas)


async def test_rule_times_header_override_and_clear(fast: SimHandle) -> None:
    once = {"match": {"contains": "magic"}, "response": {"content": "first"}, "times": 1}
    always = {"match": {"contains": "magic"}, "response": {"content": "second"}}
    await _load(fast, [once])
    await _load(fast, [always], append=True)

    async def content(body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
        r = await fast.client.post("/v1/chat/completions", json=body, headers=headers)
        return str(r.json()["choices"][0]["message"]["content"])

    assert await content(chat_body("magic words")) == "first"
    assert await content(chat_body("magic words")) == "second"
    override = {"content": "from header", "tool_calls": None}
    assert (
        await content(chat_body("magic"), {"X-Sim-Script": json.dumps(override)}) == "from header"
    )
    listed = (await fast.client.get("/sim/scripts")).json()["rules"]
    assert [r["left"] for r in listed] == [0, None]
    assert (await fast.client.delete("/sim/scripts")).json() == {"rules": []}
    assert await content(chat_body("magic words")) not in ("first", "second")
    bad = await fast.client.post("/sim/scripts", json=[{"match": {"last_user": "("}}])
    assert bad.status_code == 400


async def test_scripts_file_and_max_tokens(start_sim: StartSim, tmp_path: Path) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([{"response": {"content": "one two three four five"}}]))
    h = await start_sim(profile="fast", scripts_path=str(path))
    r = (await h.client.post("/v1/chat/completions", json=chat_body(max_tokens=3))).json()
    assert r["choices"][0]["message"]["content"] == "one two three"
    assert r["choices"][0]["finish_reason"] == "length"
    s = await sse(h.client, "/v1/completions", {"prompt": "x", "stream": True})
    assert "".join(e["choices"][0]["text"] for e in s.events) == "one two three four five"

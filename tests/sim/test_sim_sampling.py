"""The sampling parameters and structured output the simulator applies (sim/sampling.py,
sim/structured.py): each changes the reply in a way a test can see, or is refused
as vLLM refuses it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.sim.simkit import SimHandle, chat_body

PROMPT = "Tell me about queues."


async def _chat(sim: SimHandle, **kw: Any) -> dict[str, Any]:
    r = await sim.client.post("/v1/chat/completions", json=chat_body(PROMPT, **kw))
    assert r.status_code == 200, r.text
    return dict(r.json())


def _text(reply: dict[str, Any], index: int = 0) -> str:
    return str(reply["choices"][index]["message"]["content"] or "")


def _words(text: str) -> list[str]:
    return [w.lower() for w in text.replace(".", " ").split()]


async def test_seed_changes_the_text_unless_sampling_is_greedy(fast: SimHandle) -> None:
    a, b = await _chat(fast, seed=1), await _chat(fast, seed=2)
    assert _text(a) != _text(b)
    assert _text(a) == _text(await _chat(fast, seed=1))
    for greedy in ({"temperature": 0}, {"top_k": 1}, {"min_p": 1.0}):
        one, two = await _chat(fast, seed=1, **greedy), await _chat(fast, seed=2, **greedy)
        assert _text(one) == _text(two), greedy


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 1.0}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.3}]
)
async def test_penalties_draw_no_word_twice(fast: SimHandle, penalty: dict[str, float]) -> None:
    plain = _words(_text(await _chat(fast, seed=3, max_tokens=40, ignore_eos=True)))
    assert len(set(plain)) < len(plain)  # without a penalty, words repeat
    words = _words(_text(await _chat(fast, seed=3, max_tokens=40, ignore_eos=True, **penalty)))
    assert len(words) > 30
    assert len(set(words)) == len(words)


async def test_logit_bias_forces_and_bans_a_token(fast: SimHandle) -> None:
    r = await fast.client.post("/tokenize", json={"model": "sim-8b", "prompt": " kernel"})
    (kernel,) = r.json()["tokens"]
    forced = await _chat(fast, max_tokens=5, logit_bias={str(kernel): 100})
    assert _text(forced) == " kernel" * 5
    assert forced["choices"][0]["finish_reason"] == "length"
    banned = await _chat(fast, max_tokens=60, ignore_eos=True, logit_bias={str(kernel): -100})
    assert " kernel" not in _text(banned)  # the token; " Kernel" is another one


async def test_min_tokens_continues_a_short_reply(fast: SimHandle) -> None:
    r = await fast.client.post(
        "/v1/chat/completions",
        json=chat_body(PROMPT, min_tokens=6, max_tokens=16),
        headers={"X-Sim-Script": json.dumps({"content": "Ok."})},
    )
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert _text(body).startswith("Ok.")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("min_tokens", 99),
        ("logit_bias", {"999999999": 5}),
        ("guided_choice", []),
        ("structured_outputs", {"regex": "a+"}),
    ],
)
async def test_out_of_range_values_are_refused(fast: SimHandle, field: str, value: Any) -> None:
    r = await fast.client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=8, **{field: value})
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}},
    "required": ["city", "temp_c"],
}


@pytest.mark.parametrize(
    "constraint",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA},
            }
        },
        {"guided_json": SCHEMA},
        {"structured_outputs": {"json": SCHEMA}},
    ],
)
async def test_a_json_schema_shapes_the_reply(fast: SimHandle, constraint: dict[str, Any]) -> None:
    value = json.loads(_text(await _chat(fast, max_tokens=64, **constraint)))
    assert set(value) == {"city", "temp_c"}
    assert isinstance(value["temp_c"], float)


async def test_json_object_and_choices(fast: SimHandle) -> None:
    obj = json.loads(_text(await _chat(fast, response_format={"type": "json_object"})))
    assert isinstance(obj, dict)
    assert obj
    for constraint in (
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"choice": ["yes", "no"]}},
    ):
        assert _text(await _chat(fast, **constraint)) in ("yes", "no")


TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
    {
        "type": "function",
        "function": {
            "name": "b",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    },
]


def _calls(reply: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = reply["choices"][0]["message"].get("tool_calls") or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


async def test_tool_choice_forms(fast: SimHandle) -> None:
    named = await _chat(
        fast, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "b"}}
    )
    assert _calls(named) == [("b", {"x": 1})]
    assert named["choices"][0]["finish_reason"] == "tool_calls"
    required = await _chat(fast, tools=TOOLS, tool_choice="required")
    assert [name for name, _ in _calls(required)] == ["a"]
    auto = await _chat(fast, tools=TOOLS, tool_choice="auto")
    assert _calls(auto) == []
    assert _text(auto)
    unknown = await fast.client.post(
        "/v1/chat/completions",
        json=chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "z"}}),
    )
    assert unknown.status_code == 400


async def test_none_and_parallel_tool_calls_shape_a_scripted_reply(fast: SimHandle) -> None:
    script = {
        "tool_calls": [
            {"function": {"name": "a", "arguments": {}}},
            {"function": {"name": "b", "arguments": {"x": 2}}},
        ]
    }
    headers = {"X-Sim-Script": json.dumps(script)}

    async def chat(**kw: Any) -> dict[str, Any]:
        r = await fast.client.post(
            "/v1/chat/completions", json=chat_body(tools=TOOLS, **kw), headers=headers
        )
        return dict(r.json())

    assert [n for n, _ in _calls(await chat())] == ["a", "b"]
    assert [n for n, _ in _calls(await chat(parallel_tool_calls=False))] == ["a"]
    none = await chat(tool_choice="none")
    assert _calls(none) == []
    assert _text(none)
    assert none["choices"][0]["finish_reason"] == "stop"

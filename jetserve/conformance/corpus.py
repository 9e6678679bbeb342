"""The conformance cases, as data: one case per reported row (field or behaviour).

Strings may hold ``{nonce}``; the runner replaces it with a fresh value per run, so
simulator script rules installed for one run never match another run's requests.

Cases marked ``needs_sim`` use the jetserve simulator's test hooks (the ``X-Sim-Fault``
header for 429 / 5xx / malformed chunk, ``X-Sim-Script`` and ``/sim/scripts`` rules to
make the reply deterministic). A real engine cannot inject those on demand: run with
``faults_supported=False`` and they are reported ``not_applicable``; the scripted cases
then still run, with checks that hold for any model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from workers.engines import translation as t


class Check(StrEnum):
    TEXT = "text"  # some text and a finish reason
    LENGTH = "length"  # stops at max_tokens with finish_reason "length"
    TOOL_CALL = "tool_call"  # a structured tool call named as asked
    JSON = "json"  # the reply parses as a JSON object with the schema's keys
    STOP = "stop"  # the stop string never appears; finish_reason "stop"
    USAGE = "usage"  # Done carries prompt and completion token counts
    CANCEL = "cancel"  # cancelling mid-stream aborts the engine's request
    ERROR = "error"  # the adapter raises the expected EngineError subclass


@dataclass(frozen=True)
class Case:
    name: str
    row: str  # the report row (workers.engines.translation names)
    check: Check
    body: dict[str, Any]
    fault: str | None = None  # X-Sim-Fault value; the case needs the simulator
    sim_script: dict[str, Any] | None = None  # X-Sim-Script value, sent to the simulator only
    sim_rules: list[dict[str, Any]] = field(default_factory=list)  # /sim/scripts rules
    sim_slow_ms: int | None = None  # pace the simulator's stream (optional, not a fault)
    error: str | None = None  # expected workers.errors class name, for Check.ERROR
    expect: dict[str, Any] = field(default_factory=dict)  # check parameters

    @property
    def needs_sim(self) -> bool:
        return self.fault is not None


def _user(text: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": text},
    ]


_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather_{nonce}",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

_CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}},
    "required": ["city", "temp_c"],
}

CASES: tuple[Case, ...] = (
    Case(
        "plain_messages",
        t.MESSAGES,
        Check.TEXT,
        {"messages": _user("Say hello. ({nonce})"), "max_tokens": 32},
    ),
    Case(
        "max_tokens",
        t.MAX_TOKENS,
        Check.LENGTH,
        {"messages": _user("Write a long story. ({nonce})"), "max_tokens": 3},
        sim_script={"content": "one two three four five six seven eight"},
        expect={"max_tokens": 3},
    ),
    Case(
        "tool_calls",
        t.TOOLS,
        Check.TOOL_CALL,
        {
            "messages": _user("What is the weather in Paris? ({nonce})"),
            "tools": [_WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather_{nonce}"}},
            "max_tokens": 64,
        },
        # Matches only if the tool definitions reached the prompt: a dropped `tools`
        # field gets plain text back, which the check reports as a silent drop.
        sim_rules=[
            {
                "match": {"contains": "get_weather_{nonce}"},
                "response": {
                    "tool_calls": [
                        {
                            "function": {
                                "name": "get_weather_{nonce}",
                                "arguments": {"city": "Paris"},
                            }
                        }
                    ]
                },
                "times": 1,
            }
        ],
        expect={"name": "get_weather_{nonce}", "arguments": {"city": "Paris"}},
    ),
    Case(
        "json_mode",
        t.RESPONSE_FORMAT,
        Check.JSON,
        {
            "messages": _user("Weather in Paris as JSON. ({nonce})"),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": _CITY_SCHEMA},
            },
            "max_tokens": 64,
        },
        sim_script={"content": '{"city": "Paris", "temp_c": 21}'},
        expect={"keys": ["city", "temp_c"]},
    ),
    Case(
        "stop_sequences",
        t.STOP,
        Check.STOP,
        {"messages": _user("Count to five. ({nonce})"), "stop": ["four"], "max_tokens": 32},
        sim_script={"content": "one two three four five"},
        expect={"stop": "four", "sim_text": "one two three "},
    ),
    Case(
        "streaming_usage",
        t.USAGE,
        Check.USAGE,
        {
            "messages": _user("Say something. ({nonce})"),
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 16,
        },
    ),
    Case(
        "cancellation",
        t.CANCELLATION,
        Check.CANCEL,
        {"messages": _user("Talk for a long time. ({nonce})"), "max_tokens": 512},
        # A slow stream, so the request is still running when it is cancelled.
        sim_script={"content": " ".join(["word"] * 200)},
        sim_slow_ms=20,
    ),
    Case(
        "context_length_error",
        t.ERR_CONTEXT,
        Check.ERROR,
        {"messages": _user("Hi. ({nonce})"), "max_tokens": 10_000_000},
        error="EngineRejected",
    ),
    Case(
        "rate_limited",
        t.ERR_429,
        Check.ERROR,
        {"messages": _user("Hi. ({nonce})"), "max_tokens": 8},
        fault="429",
        error="EngineRateLimited",
    ),
    Case(
        "server_error",
        t.ERR_5XX,
        Check.ERROR,
        {"messages": _user("Hi. ({nonce})"), "max_tokens": 8},
        fault="503",
        error="EngineUnavailable",
    ),
    Case(
        "malformed_chunk",
        t.ERR_MALFORMED,
        Check.ERROR,
        {"messages": _user("Hi. ({nonce})"), "max_tokens": 16},
        fault="malformed:2",
        error="EngineStreamBroken",
    ),
)

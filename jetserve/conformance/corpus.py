"""The conformance cases, as data: one case per reported row (case, field or behaviour).

Strings may hold ``{nonce}``; the runner replaces it with a fresh value per run, so
simulator script rules installed for one run never match another run's requests.
``{token}`` is the id of the case's ``token_word``, asked of the engine's ``/tokenize``.

Cases marked ``needs_sim`` use the jetserve simulator's test hooks (the ``X-Sim-Fault``
header for 429 / 5xx / malformed chunk, ``X-Sim-Script`` and ``/sim/scripts`` rules to
make the reply deterministic). A real engine cannot inject those on demand: run with
``faults_supported=False`` and they are reported ``not_applicable``; the scripted cases
then still run, with checks that hold for any model. What the simulator does with each
sampling parameter (so that a dropped one shows) is in docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from streams.wire import Op
from workers.engines import translation as t


class Check(StrEnum):
    TEXT = "text"  # some text and a finish reason (on the simulator: expect.sim_text)
    LENGTH = "length"  # stops at max_tokens with finish_reason "length"
    FINISH = "finish"  # finish_reason as expected (any engine: stop or length)
    TOOL_CALL = "tool_call"  # a structured tool call named as asked
    NO_TOOL_CALL = "no_tool_call"  # text, no tool call, although a tool was offered
    TOOL_CALLS = "tool_calls"  # exactly expect.count structured calls
    JSON = "json"  # the reply parses as a JSON object with the schema's keys
    CHOICE = "choice"  # the reply is one of expect.choices
    STOP = "stop"  # no stop string appears; finish_reason "stop"
    SAME_TEXT = "same_text"  # body and body|vary give the same text; body|differ not (sim)
    DISTINCT = "distinct"  # no word twice (sim; without expect.field the words repeat)
    BIAS = "bias"  # every token is the biased one
    LOGPROBS = "logprobs"  # one logprob per token, expect.top alternatives each
    CHOICES = "choices"  # expect.n indexed choices, each with text and a finish reason
    ECHO = "echo"  # the text starts with the prompt
    MIN_TOKENS = "min_tokens"  # at least expect.min tokens
    EXACT_LENGTH = "exact_length"  # exactly expect.tokens tokens, finish "length"
    USAGE = "usage"  # Done carries prompt and completion token counts
    CACHED = "cached"  # the same prompt again reports cached prompt tokens
    CANCEL = "cancel"  # cancelling mid-stream aborts the engine's request
    ERROR = "error"  # the adapter raises the expected EngineError subclass


@dataclass(frozen=True)
class Case:
    name: str
    row: str  # the report row (workers.engines.translation names)
    check: Check
    body: dict[str, Any]
    op: Op = "chat"
    fault: str | None = None  # X-Sim-Fault value; the case needs the simulator
    sim_script: dict[str, Any] | None = None  # X-Sim-Script value, sent to the simulator only
    sim_rules: list[dict[str, Any]] = field(default_factory=list)  # /sim/scripts rules
    sim_slow_ms: int | None = None  # pace the simulator's stream (optional, not a fault)
    error: str | None = None  # expected workers.errors class name, for Check.ERROR
    token_word: str | None = None  # its token id fills {token}
    # Whether a tool is called is the model's choice (a script makes it on the
    # simulator): a real engine's plain-text answer is no drop.
    model_decides: bool = False
    # Check parameters; an ERROR case's status and message (a regex) are checked too.
    expect: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_sim(self) -> bool:
        return self.fault is not None


def _user(text: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": text},
    ]


def _tool(name: str) -> dict[str, Any]:
    """A weather tool named per case, so one case's rule never answers another's."""
    return {
        "type": "function",
        "function": {
            "name": f"{name}_{{nonce}}",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }


def _calls_rule(name: str, *cities: str) -> list[dict[str, Any]]:
    """A /sim/scripts rule that answers with calls of tool `name` (one per city), and
    matches only if the tool definitions reached the prompt: a dropped `tools` field
    gets plain text back, which the check reports as a silent drop."""
    calls = [{"function": {"name": f"{name}_{{nonce}}", "arguments": {"city": c}}} for c in cities]
    return [
        {
            "match": {"contains": f"{name}_{{nonce}}"},
            "response": {"tool_calls": calls},
            "times": 1,
        }
    ]


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"{name}_{{nonce}}"}}


_CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}},
    "required": ["city", "temp_c"],
}
# What a context-length refusal says (vLLM: "maximum context length", TGI:
# "`inputs` tokens + `max_new_tokens` must be <= N").
_CONTEXT_WORDS = "(?i)context length|context window|max_new_tokens|max_model_len|maximum"
_COUNT = "one two three four five six seven eight"
_LONG = " ".join(f"w{i}" for i in range(8300))  # past the simulator's 8192 tokens
# A system prompt long enough to fill prefix-cache blocks (16 tokens each), unique per run.
_SHARED = "({nonce}) " + " ".join(["Answer briefly and stay on topic."] * 12)


# The penalty cases' prompt: fixed (no nonce: no rule to isolate), so the simulator's
# natural reply is fixed too, and long enough that its words repeat without a penalty.
# No ignore_eos: a case checks its own field, on engines without ignore_eos (TGI) too.
_PENALTY_BODY: dict[str, Any] = {"messages": _user("Tell me about queues."), "max_tokens": 64}


def _chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"messages": _user(f"{text} ({{nonce}})"), **kw}


def _completion(text: str, **kw: Any) -> dict[str, Any]:
    return {"prompt": f"{text} ({{nonce}})", **kw}


_TEXT_AND_IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture? ({nonce})"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    }
]

_GENERATION: tuple[Case, ...] = (
    Case("plain_messages", t.MESSAGES, Check.TEXT, _chat("Say hello.", max_tokens=32)),
    Case(
        "image_url_part",
        t.CONTENT_PARTS,
        Check.TEXT,
        {"messages": _TEXT_AND_IMAGE, "max_tokens": 16},
        # The simulator renders an image part as <|media|>: the rule matches only if
        # the part reached the prompt right after the text.
        sim_rules=[
            {
                "match": {"contains": "({nonce})<|media|>"},
                "response": {"content": "A picture ({nonce})."},
                "times": 1,
            }
        ],
        expect={"sim_text": "A picture ({nonce})."},
    ),
    Case(
        "max_tokens",
        t.MAX_TOKENS,
        Check.LENGTH,
        _chat("Write a long story.", max_tokens=3),
        sim_script={"content": _COUNT},
        expect={"max_tokens": 3},
    ),
    Case(
        "max_completion_tokens",
        t.MAX_COMPLETION_TOKENS,
        Check.LENGTH,
        _chat("Write a long story.", max_completion_tokens=4),
        sim_script={"content": _COUNT},
        expect={"max_tokens": 4},
    ),
    Case(
        "finish_stop",
        t.FINISH_REASON,
        Check.FINISH,
        _chat("Say done.", max_tokens=32),
        sim_script={"content": "Done."},
        expect={"finish": "stop"},
    ),
    Case(
        "completion_length",
        t.FINISH_REASON,
        Check.LENGTH,
        _completion("Once upon a time", max_tokens=3),
        op="completion",
        sim_script={"content": _COUNT},
        expect={"max_tokens": 3},
    ),
    Case(
        "stop_sequences",
        t.STOP,
        Check.STOP,
        _chat("Count to five.", stop=["four"], max_tokens=32),
        sim_script={"content": "one two three four five"},
        expect={"stop": ["four"], "sim_text": "one two three "},
    ),
    Case(
        "stop_array",
        t.STOP,
        Check.STOP,
        _chat("Count to five.", stop=["five", "three"], max_tokens=32),
        sim_script={"content": "one two three four five"},
        expect={"stop": ["five", "three"], "sim_text": "one two "},
    ),
    Case(
        "completion_stop",
        t.STOP,
        Check.STOP,
        _completion("Count:", stop=["three"], max_tokens=32),
        op="completion",
        sim_script={"content": "one two three four"},
        expect={"stop": ["three"], "sim_text": "one two "},
    ),
    Case(
        "ignore_eos",
        t.IGNORE_EOS,
        Check.EXACT_LENGTH,
        _chat("Say ok.", max_tokens=24, ignore_eos=True),
        sim_script={"content": "Ok."},
        expect={"tokens": 24},
    ),
    Case(
        "min_tokens",
        t.MIN_TOKENS,
        Check.MIN_TOKENS,
        _chat("Say ok.", max_tokens=16, min_tokens=6),
        sim_script={"content": "Ok."},
        expect={"min": 6},
    ),
)

_TOOLS: tuple[Case, ...] = (
    Case(
        "tool_calls",
        t.TOOLS,
        Check.TOOL_CALL,
        _chat(
            "What is the weather in Paris?",
            tools=[_tool("get_weather")],
            tool_choice=_named("get_weather"),
            max_tokens=64,
        ),
        sim_rules=_calls_rule("get_weather", "Paris"),
        expect={"name": "get_weather_{nonce}", "arguments": {"city": "Paris"}},
    ),
    Case(
        "parallel_tool_calls",
        t.TOOLS,
        Check.TOOL_CALLS,
        _chat("Weather in Paris and Rome?", tools=[_tool("weather_two")], max_tokens=64),
        sim_rules=_calls_rule("weather_two", "Paris", "Rome"),
        expect={"count": 2, "name": "weather_two_{nonce}"},
        model_decides=True,
    ),
    Case(
        "tool_choice_auto",
        t.TOOL_CHOICE,
        Check.TOOL_CALL,
        _chat("Weather in Oslo?", tools=[_tool("weather_auto")], tool_choice="auto", max_tokens=64),
        sim_rules=_calls_rule("weather_auto", "Oslo"),
        expect={"name": "weather_auto_{nonce}", "arguments": {"city": "Oslo"}},
        model_decides=True,
    ),
    Case(
        "tool_choice_required",
        t.TOOL_CHOICE,
        Check.TOOL_CALL,
        # No rule: the engine itself must force a call.
        _chat(
            "Weather anywhere?",
            tools=[_tool("weather_required")],
            tool_choice="required",
            max_tokens=64,
        ),
        expect={"name": "weather_required_{nonce}", "arguments": {"city": "sim"}},
    ),
    Case(
        "tool_choice_named",
        t.TOOL_CHOICE,
        Check.TOOL_CALL,
        _chat(
            "Weather anywhere?",
            tools=[_tool("weather_other"), _tool("weather_named")],
            tool_choice=_named("weather_named"),
            max_tokens=64,
        ),
        expect={"name": "weather_named_{nonce}", "arguments": {"city": "sim"}},
    ),
    Case(
        "tool_choice_none",
        t.TOOL_CHOICE,
        Check.NO_TOOL_CALL,
        # The rule would call the tool: "none" must win over it.
        _chat("Weather in Lima?", tools=[_tool("weather_none")], tool_choice="none", max_tokens=32),
        sim_rules=_calls_rule("weather_none", "Lima"),
    ),
    Case(
        "parallel_tool_calls_false",
        t.PARALLEL_TOOL_CALLS,
        Check.TOOL_CALLS,
        _chat(
            "Weather in Paris and Rome?",
            tools=[_tool("weather_one")],
            parallel_tool_calls=False,
            max_tokens=64,
        ),
        sim_rules=_calls_rule("weather_one", "Paris", "Rome"),
        expect={"count": 1, "name": "weather_one_{nonce}"},
        model_decides=True,
    ),
)

_STRUCTURED: tuple[Case, ...] = (
    Case(
        "json_mode",
        t.RESPONSE_FORMAT,
        Check.JSON,
        _chat(
            "Weather in Paris as JSON.",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": _CITY_SCHEMA},
            },
            max_tokens=64,
        ),
        expect={"keys": ["city", "temp_c"]},
    ),
    Case(
        "json_object",
        t.RESPONSE_FORMAT,
        Check.JSON,
        _chat("Any JSON object.", response_format={"type": "json_object"}, max_tokens=64),
        expect={"keys": []},
    ),
    Case(
        "guided_json",
        t.STRUCTURED_OUTPUTS,
        Check.JSON,
        _chat("Weather in Paris as JSON.", guided_json=_CITY_SCHEMA, max_tokens=64),
        expect={"keys": ["city", "temp_c"]},
    ),
    Case(
        "structured_outputs_json",
        t.STRUCTURED_OUTPUTS,
        Check.JSON,
        _chat("Weather as JSON.", structured_outputs={"json": _CITY_SCHEMA}, max_tokens=64),
        expect={"keys": ["city", "temp_c"]},
    ),
    Case(
        "guided_choice",
        t.STRUCTURED_OUTPUTS,
        Check.CHOICE,
        _chat("Is it sunny?", guided_choice=["sunny", "cloudy"], max_tokens=8),
        expect={"choices": ["sunny", "cloudy"]},
    ),
)

_SAMPLING: tuple[Case, ...] = (
    Case(
        "seed",
        t.SEED,
        Check.SAME_TEXT,
        _chat("Tell me about queues.", seed=7, temperature=1.0, max_tokens=24),
        expect={"vary": {}, "differ": {"seed": 8}},
    ),
    Case(
        "temperature_zero",
        t.TEMPERATURE,
        Check.SAME_TEXT,
        _chat("Tell me about queues.", seed=1, temperature=0, max_tokens=24),
        expect={"vary": {"seed": 2}},
    ),
    Case(
        "top_k",
        t.TOP_K,
        Check.SAME_TEXT,
        _chat("Tell me about queues.", seed=1, top_k=1, max_tokens=24),
        expect={"vary": {"seed": 2}},
    ),
    Case(
        "min_p",
        t.MIN_P,
        Check.SAME_TEXT,
        _chat("Tell me about queues.", seed=1, min_p=1.0, max_tokens=24),
        expect={"vary": {"seed": 2}},
    ),
    Case(
        "presence_penalty",
        t.PRESENCE_PENALTY,
        Check.DISTINCT,
        _PENALTY_BODY | {"presence_penalty": 1.5},
        expect={"field": "presence_penalty"},
    ),
    Case(
        "frequency_penalty",
        t.FREQUENCY_PENALTY,
        Check.DISTINCT,
        _PENALTY_BODY | {"frequency_penalty": 1.0},
        expect={"field": "frequency_penalty"},
    ),
    Case(
        "repetition_penalty",
        t.REPETITION_PENALTY,
        Check.DISTINCT,
        _PENALTY_BODY | {"repetition_penalty": 1.5},
        expect={"field": "repetition_penalty"},
    ),
    Case(
        "logit_bias",
        t.LOGIT_BIAS,
        Check.BIAS,
        _chat("Say anything.", logit_bias={"{token}": 100}, max_tokens=5),
        token_word=" kernel",
        expect={"word": " kernel", "tokens": 5},
    ),
)

_CHOICES: tuple[Case, ...] = (
    Case(
        "logprobs",
        t.LOGPROBS,
        Check.LOGPROBS,
        _chat("Say something.", logprobs=True, max_tokens=8),
        expect={"top": 0},
    ),
    Case(
        "top_logprobs",
        t.LOGPROBS,
        Check.LOGPROBS,
        _chat("Say something.", logprobs=True, top_logprobs=3, max_tokens=8),
        expect={"top": 3},
    ),
    Case(
        "completion_logprobs",
        t.LOGPROBS,
        Check.LOGPROBS,
        _completion("The queue", logprobs=2, max_tokens=8),
        op="completion",
        expect={"top": 2},
    ),
    Case(
        "n_chat",
        t.N,
        Check.CHOICES,
        _chat("Name a colour.", n=3, seed=5, max_tokens=8),
        expect={"n": 3},
    ),
    Case(
        "n_completion",
        t.N,
        Check.CHOICES,
        _completion("A colour:", n=2, seed=5, max_tokens=8),
        op="completion",
        expect={"n": 2},
    ),
    Case(
        "best_of",
        t.BEST_OF,
        Check.CHOICES,
        _completion("A colour:", best_of=3, max_tokens=8),
        op="completion",
        expect={"n": 1},
    ),
    Case(
        "echo",
        t.ECHO,
        Check.ECHO,
        _completion("Echo me", echo=True, max_tokens=4),
        op="completion",
        expect={"prompt": "Echo me ({nonce})"},
    ),
)

_USAGE: tuple[Case, ...] = (
    Case(
        "streaming_usage",
        t.USAGE,
        Check.USAGE,
        _chat(
            "Say something.",
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=16,
        ),
    ),
    Case(
        "cached_tokens",
        t.CACHED_TOKENS,
        Check.CACHED,
        {
            "messages": [
                {"role": "system", "content": _SHARED},
                {"role": "user", "content": "Hi."},
            ],
            "max_tokens": 4,
        },
    ),
    Case(
        "cancellation",
        t.CANCELLATION,
        Check.CANCEL,
        _chat("Talk for a long time.", max_tokens=512),
        # A slow stream, so the request is still running when it is cancelled.
        sim_script={"content": " ".join(["word"] * 200)},
        sim_slow_ms=20,
    ),
)

_ERRORS: tuple[Case, ...] = (
    Case(
        "context_length_error",
        t.ERR_CONTEXT,
        Check.ERROR,
        _chat("Hi.", max_tokens=10_000_000),
        error="EngineRejected",
        expect={"status": 400, "message": _CONTEXT_WORDS},
    ),
    Case(
        "prompt_too_long",
        t.ERR_CONTEXT,
        Check.ERROR,
        _chat(_LONG, max_tokens=8),
        error="EngineRejected",
        expect={"status": 400, "message": _CONTEXT_WORDS},
    ),
    Case(
        "unknown_model",
        t.ERR_MODEL,
        Check.ERROR,
        _chat("Hi.", model="no-such-model-{nonce}", max_tokens=8),
        error="EngineRejected",
        expect={"status": 404, "message": "no-such-model"},
    ),
    Case(
        "invalid_parameter",
        t.ERR_INVALID,
        Check.ERROR,
        _chat("Hi.", presence_penalty=5.0, max_tokens=8),
        error="EngineRejected",
        # The engine's refusal in its words (or the adapter's, which cannot carry it).
        expect={"status": 400, "message": "presence_penalty"},
    ),
    Case(
        "rate_limited",
        t.ERR_429,
        Check.ERROR,
        _chat("Hi.", max_tokens=8),
        fault="429",
        error="EngineRateLimited",
    ),
    Case(
        "server_error",
        t.ERR_5XX,
        Check.ERROR,
        _chat("Hi.", max_tokens=8),
        fault="503",
        error="EngineUnavailable",
    ),
    Case(
        "server_error_500",
        t.ERR_5XX,
        Check.ERROR,
        _chat("Hi.", max_tokens=8),
        fault="500",
        error="EngineUnavailable",
    ),
    Case(
        "malformed_chunk",
        t.ERR_MALFORMED,
        Check.ERROR,
        _chat("Hi.", max_tokens=16),
        fault="malformed:2",
        error="EngineStreamBroken",
    ),
)

CASES: tuple[Case, ...] = (
    *_GENERATION,
    *_TOOLS,
    *_STRUCTURED,
    *_SAMPLING,
    *_CHOICES,
    *_USAGE,
    *_ERRORS,
)

"""What the TGI and Triton adapters send for an OpenAI/vLLM body: each field under its
engine's own name and shape, and a 400 ``unsupported_parameter`` naming what the engine
lacks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.engines.tgi_request import TgiRequest
from workers.engines.token_logprobs import TokenLogprob, Track
from workers.engines.triton import _entries
from workers.engines.triton_request import TritonRequest
from workers.errors import EngineRejected, EngineUnsupported

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def _tgi(**body: Any) -> dict[str, Any]:
    params: dict[str, Any] = TgiRequest("chat", {**CHAT, **body}).payload()["parameters"]
    return params


def _sampling(op: str = "chat", **body: Any) -> dict[str, Any]:
    base = CHAT if op == "chat" else {"prompt": "hi", "max_tokens": 8}
    req = TritonRequest("chat" if op == "chat" else "completion", {**base, **body})
    out: dict[str, Any] = json.loads(req.payload()["sampling_parameters"])
    return out


def test_tgi_names_and_shapes() -> None:
    p = _tgi(top_k=5, top_p=0.9, frequency_penalty=0.5, repetition_penalty=1.2, seed=3)
    assert p["top_k"] == 5
    assert p["top_p"] == 0.9
    assert p["frequency_penalty"] == 0.5
    assert p["repetition_penalty"] == 1.2
    assert p["seed"] == 3
    assert p["do_sample"] is True  # OpenAI samples by default, TGI does not
    assert p["max_new_tokens"] == 8
    # OpenAI's "off" values TGI refuses are left out: they ask for nothing.
    off = _tgi(top_p=1.0, top_k=-1)
    assert "top_p" not in off
    assert "top_k" not in off
    greedy = _tgi(temperature=0, seed=4)
    assert "do_sample" not in greedy
    assert "seed" not in greedy


def test_tgi_logprobs_choices_and_grammar() -> None:
    assert _tgi(logprobs=True, top_logprobs=3)["top_n_tokens"] == 3
    assert "top_n_tokens" not in _tgi(logprobs=True)
    regex = _tgi(guided_choice=["a.b", "c|d"])["grammar"]
    assert regex == {"type": "regex", "value": "(?:a\\.b|c\\|d)"}
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    assert _tgi(structured_outputs={"json": schema})["grammar"] == {"type": "json", "value": schema}
    req = TgiRequest("chat", {**CHAT, "n": 3, "seed": 10})
    assert [req.payload(i)["parameters"]["seed"] for i in range(3)] == [10, 11, 12]


def test_tgi_best_of_goes_to_generate() -> None:
    req = TgiRequest("completion", {"prompt": "hi", "best_of": 3})
    assert req.best_of == 3
    assert req.params["best_of"] == 3
    assert req.params["decoder_input_details"] is True
    with pytest.raises(EngineUnsupported, match="best_of"):
        TgiRequest("completion", {"prompt": "hi", "best_of": 3, "n": 2})


@pytest.mark.parametrize("field", ["presence_penalty", "min_p", "min_tokens", "logit_bias"])
def test_tgi_refuses_what_it_lacks(field: str) -> None:
    value: Any = {"5": 1} if field == "logit_bias" else 1
    with pytest.raises(EngineUnsupported, match=f"TGI cannot do {field}") as info:
        TgiRequest("chat", {**CHAT, field: value})
    assert info.value.code == "unsupported_parameter"


def test_tgi_echo_with_logprobs_is_refused() -> None:
    with pytest.raises(EngineUnsupported, match="echo"):
        TgiRequest("completion", {"prompt": "hi", "echo": True, "logprobs": 1})


def test_triton_sends_vllm_sampling_parameters() -> None:
    fields: dict[str, Any] = {
        "top_k": 2,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "min_tokens": 2,
        "ignore_eos": True,
        "seed": 1,
        "n": 2,
        "stop": ["x", "y"],
    }
    s = _sampling(**fields)
    assert {k: s[k] for k in fields} == fields
    assert s["max_tokens"] == 8
    payload = TritonRequest("chat", {**CHAT, "logprobs": True, "top_logprobs": 2}).payload()
    assert payload["stream"] is True
    assert payload["return_logprobs"] is True
    assert json.loads(payload["sampling_parameters"])["logprobs"] == 2
    assert "parameters" not in payload  # scalars only there: lists could not go


def test_triton_structured_outputs_and_forced_tools() -> None:
    s = _sampling(guided_choice=["a", "b"])
    assert json.loads(s["structured_outputs"]) == {"choice": ["a", "b"]}
    fmt = {"type": "json_object"}
    assert json.loads(_sampling(response_format=fmt)["structured_outputs"]) == {
        "json": {"type": "object"}
    }
    forced = _sampling(tools=[TOOL], tool_choice="required")
    schema = json.loads(forced["structured_outputs"])["json"]
    assert schema["properties"]["name"] == {"const": "get_weather"}


def test_triton_best_of_is_n_with_cumulative_logprob() -> None:
    req = TritonRequest("completion", {"prompt": "hi", "best_of": 3})
    payload = req.payload()
    assert json.loads(payload["sampling_parameters"])["n"] == 3
    assert payload["return_cumulative_logprob"] is True
    with pytest.raises(EngineUnsupported, match="logit_bias"):
        TritonRequest("chat", {**CHAT, "logit_bias": {"5": 1}})


def test_track_releases_logprobs_with_their_text() -> None:
    track = Track("chat")
    for tok in ("one", " two", " st", "op"):
        track.push(TokenLogprob(tok, -0.5, ((tok, -0.5),)))
    first = track.take(len("one tw"))  # " two" is still held back
    assert first is not None
    assert [e["token"] for e in first["content"]] == ["one"]
    second = track.take(len("one two"))  # the stop string " stop" was cut
    assert second is not None
    assert [e["token"] for e in second["content"]] == [" two"]
    assert track.take(len("one two")) is None
    legacy = Track("completion", offset=3)
    legacy.push(TokenLogprob("a", -1.0, (("a", -1.0), ("b", -2.0))))
    assert legacy.take(1) == {
        "text_offset": [3],
        "token_logprobs": [-1.0],
        "tokens": ["a"],
        "top_logprobs": [{"a": -1.0, "b": -2.0}],
    }


def test_triton_logprobs_sampled_first_then_top_by_rank() -> None:
    raw = json.dumps(
        [{"7": {"logprob": -3.0, "rank": 4, "decoded_token": " z"},
          "1": {"logprob": -0.1, "rank": 1, "decoded_token": " a"},
          "2": {"logprob": -0.9, "rank": 2, "decoded_token": " b"}}]
    )  # fmt: skip
    (entry,) = _entries(raw, 2)
    assert entry.token == " z"
    assert entry.logprob == -3.0
    assert entry.top == ((" a", -0.1), (" b", -0.9))


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 5.0), ("top_p", 0.0), ("min_p", 2.0), ("repetition_penalty", 0)],
)
def test_triton_checks_vllm_ranges_before_sending(field: str, value: float) -> None:
    # The backend would log vLLM's refusal and fail the request without its words.
    with pytest.raises(EngineRejected, match=field) as info:
        TritonRequest("chat", {**CHAT, field: value})
    assert info.value.status == 400


def test_tool_choice_without_tools_and_too_many_choices_are_refused() -> None:
    for cls in (TgiRequest, TritonRequest):
        with pytest.raises(EngineRejected, match="tools"):
            cls("chat", {**CHAT, "tool_choice": "required"})
    with pytest.raises(EngineRejected, match="n must be"):
        TgiRequest("chat", {**CHAT, "n": 17})

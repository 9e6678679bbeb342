"""Request parsing: what the gateway cannot relay is refused, never dropped."""

from __future__ import annotations

import msgspec
import pytest

from gateway.errors import BadRequest
from gateway.inference.openai_types import (
    ChatRequest,
    CompletionRequest,
    choices_of,
    merge_logprobs,
    parse_body,
)


@pytest.mark.parametrize(
    ("kind", "extra", "param"),
    [
        (CompletionRequest, {"echo": True}, "echo"),
        (CompletionRequest, {"best_of": 3}, "best_of"),
        (CompletionRequest, {"suffix": "end"}, "suffix"),
    ],
)
def test_fields_the_relay_cannot_carry_are_refused(
    kind: type[ChatRequest] | type[CompletionRequest], extra: dict[str, object], param: str
) -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    with pytest.raises(BadRequest) as info:
        parse_body(msgspec.json.encode({**base, **extra}), kind)
    assert info.value.param == param
    assert info.value.code == "unsupported_parameter"


def test_logprobs_are_carried_and_checked() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    typed, _ = parse_body(
        msgspec.json.encode({**chat, "logprobs": True, "top_logprobs": 5}), ChatRequest
    )
    assert isinstance(typed, ChatRequest)
    assert typed.top_logprobs == 5
    with pytest.raises(BadRequest) as info:  # alternatives of nothing
        parse_body(msgspec.json.encode({**chat, "top_logprobs": 2}), ChatRequest)
    assert info.value.param == "top_logprobs"
    with pytest.raises(BadRequest):  # OpenAI's bound
        parse_body(msgspec.json.encode({**chat, "logprobs": True, "top_logprobs": 21}), ChatRequest)
    legacy = {"model": "m", "prompt": "hi", "logprobs": 3}
    typed, _ = parse_body(msgspec.json.encode(legacy), CompletionRequest)
    assert isinstance(typed, CompletionRequest)
    assert typed.logprobs == 3


def test_merged_logprobs_concatenate_in_order() -> None:
    chat = [{"content": [{"token": "a"}]}, None, {"content": [{"token": "b"}], "refusal": None}]
    assert merge_logprobs(chat) == {"content": [{"token": "a"}, {"token": "b"}], "refusal": None}
    legacy = [
        {"tokens": [t], "token_logprobs": [lp], "top_logprobs": [{t: lp}], "text_offset": [i]}
        for i, (t, lp) in enumerate([("a", -1.0), ("b", -2.0)])
    ]
    assert merge_logprobs(legacy) == {
        "tokens": ["a", "b"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"a": -1.0}, {"b": -2.0}],
        "text_offset": [0, 1],
    }
    one = {"content": [{"token": "a"}]}
    assert merge_logprobs([None, one]) == one
    assert merge_logprobs([None, None]) is None


def test_their_defaults_pass() -> None:
    body = {"model": "m", "prompt": "hi", "logprobs": None, "echo": False, "best_of": 1}
    typed, raw = parse_body(msgspec.json.encode(body), CompletionRequest)
    assert isinstance(typed, CompletionRequest)
    assert raw["best_of"] == 1


def test_choices_count_n_per_prompt_of_a_batch() -> None:
    def completion(prompt: object, n: int = 1) -> CompletionRequest:
        body = {"model": "m", "prompt": prompt, "n": n}
        typed, _ = parse_body(msgspec.json.encode(body), CompletionRequest)
        assert isinstance(typed, CompletionRequest)
        return typed

    assert choices_of(completion("one", 3)) == 3
    assert choices_of(completion([1, 2, 3], 2)) == 2  # token ids: one prompt
    assert choices_of(completion(["a", "b"], 2)) == 4
    assert choices_of(completion([[1, 2], [3]])) == 2
    with pytest.raises(BadRequest):  # capped before any work
        completion("x", 17)

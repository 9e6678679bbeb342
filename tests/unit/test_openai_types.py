"""Request parsing: types and bounds checked before any work; the rest goes to the engine."""

from __future__ import annotations

import msgspec
import pytest

from gateway.errors import BadRequest
from gateway.inference.openai_types import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    bound_prompt_tokens,
    choices_of,
    merge_logprobs,
    parse_body,
    sequences_of,
)


def test_echo_best_of_and_suffix_go_to_the_engine() -> None:
    # The relay carries what they change (text, and choices by index): the engine
    # decides (vLLM refuses suffix itself, with its own 400).
    body = {"model": "m", "prompt": "hi", "echo": True, "best_of": 3, "n": 2, "suffix": "x"}
    typed, raw = parse_body(msgspec.json.encode(body), CompletionRequest)
    assert isinstance(typed, CompletionRequest)
    assert (typed.echo, typed.best_of, typed.suffix) == (True, 3, "x")
    assert raw == body
    assert choices_of(typed) == 2
    assert sequences_of(typed) == 3  # generated, so held for
    with pytest.raises(BadRequest) as info:
        parse_body(msgspec.json.encode({**body, "best_of": 1}), CompletionRequest)
    assert info.value.param == "best_of"


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


def test_a_batchs_hold_allows_each_inputs_special_tokens() -> None:
    """A BERT-style model adds [CLS] and [SEP] to every input: 500 empty inputs
    cost 1000 tokens, and were held as 32 (one allowance per request), so
    concurrent requests could overrun a budget. Each input gets its allowance."""
    empty, _ = parse_body(
        msgspec.json.encode({"model": "sim-embed", "input": [""] * 500}), EmbeddingRequest
    )
    assert bound_prompt_tokens(empty) >= 2 * 500
    one, _ = parse_body(
        msgspec.json.encode({"model": "sim-embed", "input": "abc"}), EmbeddingRequest
    )
    assert bound_prompt_tokens(one) == 3 + 16 + 16  # unchanged for a single input
    prompts, _ = parse_body(
        msgspec.json.encode({"model": "sim-8b", "prompt": [""] * 100}), CompletionRequest
    )
    assert bound_prompt_tokens(prompts) >= 100  # a BOS each, at least

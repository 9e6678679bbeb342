"""Request parsing: what the gateway cannot relay is refused, never dropped."""

from __future__ import annotations

import msgspec
import pytest

from gateway.errors import BadRequest
from gateway.inference.openai_types import ChatRequest, CompletionRequest, parse_body


@pytest.mark.parametrize(
    ("kind", "extra", "param"),
    [
        (ChatRequest, {"logprobs": True}, "logprobs"),
        (ChatRequest, {"top_logprobs": 3}, "top_logprobs"),
        (CompletionRequest, {"logprobs": 2}, "logprobs"),
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


def test_their_defaults_pass() -> None:
    body = {"model": "m", "prompt": "hi", "logprobs": None, "echo": False, "best_of": 1}
    typed, raw = parse_body(msgspec.json.encode(body), CompletionRequest)
    assert isinstance(typed, CompletionRequest)
    assert raw["best_of"] == 1

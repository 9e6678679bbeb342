"""The llama.cpp adapter's request translation (workers/engines/llamacpp_request.py):
what llama.cpp's server would ignore is re-expressed or refused, never sent to be
dropped. The real server checks the same in the opt-in tier (tests/llamacpp)."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engines.llamacpp_request import LlamaCppRequest, choice_grammar
from workers.errors import EngineRejected, EngineUnsupported

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **kw}


def test_renamed_fields_reach_the_servers_names() -> None:
    req = LlamaCppRequest("chat", chat(max_completion_tokens=5, repetition_penalty=1.3))
    assert req.base["max_tokens"] == 5
    assert req.base["repeat_penalty"] == 1.3
    assert "max_completion_tokens" not in req.base
    assert "repetition_penalty" not in req.base


@pytest.mark.parametrize(
    "body",
    [
        chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
        chat(guided_json=SCHEMA),
        chat(structured_outputs={"json": SCHEMA}),
    ],
    ids=["json_schema", "guided_json", "structured_outputs"],
)
def test_json_schemas_become_the_servers_json_object_format(body: dict[str, Any]) -> None:
    req = LlamaCppRequest("chat", body)
    assert req.base["response_format"] == {"type": "json_object", "schema": SCHEMA}
    assert "guided_json" not in req.base
    assert "structured_outputs" not in req.base


def test_a_choice_becomes_a_gbnf_grammar() -> None:
    req = LlamaCppRequest("chat", chat(guided_choice=["sunny", 'say "hi"']))
    assert req.base["grammar"] == 'root ::= "sunny" | "say \\"hi\\""'
    assert choice_grammar(["a"]) == 'root ::= "a"'


def test_required_with_one_tool_names_it_and_several_are_refused() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    req = LlamaCppRequest("chat", chat(tools=[tool], tool_choice="required"))
    assert req.base["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    other = {"type": "function", "function": {"name": "g", "parameters": SCHEMA}}
    with pytest.raises(EngineUnsupported):
        LlamaCppRequest("chat", chat(tools=[tool, other], tool_choice="required"))


def test_n_is_n_requests_with_their_own_seeds() -> None:
    req = LlamaCppRequest("chat", chat(n=3, seed=5))
    assert req.n == 3
    assert "n" not in req.base
    assert [req.payload(i)["seed"] for i in range(3)] == [5, 6, 7]
    with pytest.raises(EngineRejected):
        LlamaCppRequest("chat", chat(n=17))


def test_chat_logprobs_alone_ask_for_zero_alternatives() -> None:
    assert LlamaCppRequest("chat", chat(logprobs=True)).base["top_logprobs"] == 0
    assert LlamaCppRequest("chat", chat(logprobs=True, top_logprobs=2)).base["top_logprobs"] == 2


def test_echo_is_sent_ahead_by_the_adapter() -> None:
    req = LlamaCppRequest("completion", {"prompt": ["Say"], "echo": True, "max_tokens": 2})
    assert req.echo == "Say"
    assert "echo" not in req.base
    assert req.base["prompt"] == "Say"
    with pytest.raises(EngineUnsupported):
        LlamaCppRequest("completion", {"prompt": "Say", "echo": True, "logprobs": 1})


def test_text_parts_are_joined_and_an_image_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = LlamaCppRequest("chat", {"messages": [{"role": "user", "content": parts}]})
    assert req.base["messages"][0]["content"] == "ab"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    with pytest.raises(EngineUnsupported, match="image_url"):
        LlamaCppRequest("chat", {"messages": [{"role": "user", "content": [image]}]})


@pytest.mark.parametrize(
    ("body", "op"),
    [
        (chat(ignore_eos=True), "chat"),
        (chat(guided_regex="a+"), "chat"),
        (chat(structured_outputs={"grammar": "root ::= x"}), "chat"),
        ({"prompt": "p", "best_of": 3}, "completion"),
        ({"prompt": ["a", "b"]}, "completion"),
        ({"prompt": "p", "guided_json": SCHEMA}, "completion"),
        (chat(no_such_field=1), "chat"),
    ],
    ids=["ignore_eos", "regex", "grammar", "best_of", "prompt_batch", "json_completion", "unknown"],
)
def test_what_the_server_would_ignore_is_refused(body: dict[str, Any], op: Any) -> None:
    with pytest.raises(EngineUnsupported) as err:
        LlamaCppRequest(op, body)
    assert err.value.code == "unsupported_parameter"
    assert err.value.status == 400

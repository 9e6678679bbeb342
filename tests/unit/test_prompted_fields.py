"""The prompted dialects (TGI, Triton) refuse what they cannot carry, with the
OpenAI code a client can act on, and let a field's do-nothing default through."""

from __future__ import annotations

import pytest

from workers.engines.prompted import check_fields
from workers.errors import EngineRejected, EngineUnsupported

CARRIED = ("messages", "max_tokens")
BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("extra", [{"logprobs": True}, {"top_logprobs": 2}, {"echo": True}])
def test_an_uncarried_field_is_an_unsupported_parameter(extra: dict[str, object]) -> None:
    with pytest.raises(EngineUnsupported) as info:
        check_fields({**BASE, **extra}, CARRIED, "TGI")
    assert info.value.code == "unsupported_parameter"
    assert info.value.status == 400
    assert next(iter(extra)) in str(info.value)


def test_defaults_that_ask_for_nothing_pass() -> None:
    check_fields({**BASE, "logprobs": False, "top_logprobs": None}, CARRIED, "TGI")


def test_n_above_one_is_refused() -> None:
    with pytest.raises(EngineRejected):
        check_fields({**BASE, "n": 2}, CARRIED, "Triton")

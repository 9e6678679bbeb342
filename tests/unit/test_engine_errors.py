"""Engine error bodies become a plain message, whatever their shape: never a
Python bytes literal in the client's error (issue 17, a real-vLLM finding)."""

from __future__ import annotations

import pytest

from workers.engines.http import error_message, raise_for_status
from workers.errors import EngineRateLimited, EngineRejected, EngineUnavailable


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "bad model", "type": "NotFoundError"}}', "bad model"),
        (b'{"message": "too long"}', "too long"),
        (b'{"error": "overloaded"}', "overloaded"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (
            b'{"object": "error", "detail": {"loc": []}}',
            '{"object": "error", "detail": {"loc": []}}',
        ),
        (b"plain text failure", "plain text failure"),
        (b"\xff\xfe broken", "\ufffd\ufffd broken"),
    ],
)
def test_the_message_is_text(body: bytes, message: str) -> None:
    assert error_message(body) == message
    assert not error_message(body).startswith("b'")


def test_statuses_map_to_the_error_classes() -> None:
    with pytest.raises(EngineRejected) as info:
        raise_for_status(404, b'{"detail":"Not Found"}')
    assert (info.value.status, str(info.value)) == (404, "Not Found")
    with pytest.raises(EngineRateLimited):
        raise_for_status(429, b"{}")
    with pytest.raises(EngineUnavailable):
        raise_for_status(500, b"oops")

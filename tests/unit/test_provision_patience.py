"""Provisioning waits out a busy server (streams/provision.py, ``patiently``):
nats-server answers JetStream API requests from a queue, and behind a burst of
fsynced consumer creations or a Raft group forming, an answer can come after the
client's 5 s. A parallel CI run saw a gateway exit at start-up on such a timeout,
and three concurrent provisioners fail a consumer listing. Every provisioning
call is idempotent, so it is asked again; any other error is not waited out."""

from __future__ import annotations

import nats.errors
import pytest
from nats.js.errors import APIError

from streams import provision
from streams.provision import patiently


class _Server:
    """Answers only after ``busy`` requests have timed out."""

    def __init__(self, busy: int, error: Exception | None = None) -> None:
        self.busy, self.error, self.asked = busy, error, 0

    async def ask(self, what: str, *, suffix: str = "") -> str:
        self.asked += 1
        if self.asked <= self.busy:
            raise nats.errors.TimeoutError
        if self.error is not None:
            raise self.error
        return what + suffix


async def test_a_call_that_times_out_is_asked_again_until_it_is_answered() -> None:
    server = _Server(busy=3)
    assert await patiently("stream S", server.ask, "S", suffix="!") == "S!"
    assert server.asked == 4


async def test_it_gives_up_past_its_patience(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provision, "PATIENCE_S", 0.0)
    server = _Server(busy=10)
    with pytest.raises(nats.errors.TimeoutError):
        await patiently("stream S", server.ask, "S")
    assert server.asked == 1


async def test_an_answer_that_is_an_error_is_not_asked_again() -> None:
    server = _Server(busy=0, error=APIError(description="stream name already in use"))
    with pytest.raises(APIError):
        await patiently("stream S", server.ask, "S")
    assert server.asked == 1

"""Slow-consumer drops are counted and said at most once per interval
(streams/connect.py): nats-py reports each dropped message from the connection's
read loop, and a warning per message slowed that loop under a flood."""

from __future__ import annotations

import logging

import pytest

from streams.connect import _SlowConsumers


def test_drops_are_said_once_then_counted_until_the_next_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("streams.connect.time.monotonic", lambda: now[0])
    slow = _SlowConsumers("gateway")
    with caplog.at_level(logging.WARNING, logger="streams.connect"):
        slow.dropped("jetserve.api.chat")  # the first is said at once
        for _ in range(999):
            slow.dropped("jetserve.api.chat")
        slow.dropped("jetserve.api.embeddings")
        assert len(caplog.records) == 1
        now[0] += _SlowConsumers.EVERY_S
        slow.dropped("jetserve.api.chat")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "1 on jetserve.api.chat" in lines[0]
    assert "1000 on jetserve.api.chat" in lines[1]
    assert "1 on jetserve.api.embeddings" in lines[1]

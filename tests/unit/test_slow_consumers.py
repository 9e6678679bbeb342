"""Slow-consumer drops are counted per subscription and said at most once per
interval (streams/connect.py): nats-py reports each dropped message from the
connection's read loop, and a warning per message slowed that loop under a flood."""

from __future__ import annotations

import logging

import pytest

from streams.connect import _SlowConsumers
from tests.waits import until_true


async def test_drops_are_said_once_then_counted_until_the_interval_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow = _SlowConsumers("gateway", every_s=0.2)
    with caplog.at_level(logging.WARNING, logger="streams.connect"):
        slow.dropped("jetserve.api.chat")  # the first is said at once
        for _ in range(999):
            slow.dropped("jetserve.api.chat")
        slow.dropped("jetserve.api.embeddings")
        assert len(caplog.records) == 1
        # The rest are said when the interval ends, with no further drop to prompt it.
        await until_true(lambda: len(caplog.records) == 2, "the interval's count")
    lines = [r.getMessage() for r in caplog.records]
    assert "1 on jetserve.api.chat" in lines[0]
    assert "999 on jetserve.api.chat" in lines[1]
    assert "1 on jetserve.api.embeddings" in lines[1]

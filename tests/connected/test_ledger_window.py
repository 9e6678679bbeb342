"""The rollout guard's ledger window (gateway/admin/ledger_window.py) against a
real nats-server: a standing read that takes each record once, a window that
starts with one scan back to its horizon, forgets what is older, and starts
again when its follower is lost."""

from __future__ import annotations

import time

import pytest

from gateway.admin.ledger_window import LedgerWindow
from gateway.tenancy.request_ledger import LedgerFollowLost, LedgerReader, LedgerWriter
from tests.connected.test_ledger import STREAM, Bus, bus, consumers, record

pytestmark = pytest.mark.connected
__all__ = ["bus"]  # the fixture, used by name


async def test_the_window_reads_each_record_once_and_keeps_its_horizon(bus: Bus) -> None:
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    now = time.time()
    at_r2 = {"route": "r", "route_revision": 2}
    old = [record("acme", i, created=now - 500, **at_r2) for i in range(3)]
    recent = [record("acme", 10 + i, created=now - 5, **at_r2) for i in range(4)]
    other = [record("beta", i, route="q", route_revision=1) for i in range(2)]
    for r in [*old, *recent, *other]:
        await writer.append(r)
    window = LedgerWindow(reader)
    try:
        await window.advance(60.0, now)
        # The scan back reads what the server stored since the horizon (all of it
        # here: stored just now), and the window keeps only what was created since.
        assert window.records_read == 9
        assert len(window.samples("r", 2)) == 4
        assert window.samples("r", 1) == []
        assert [s.rollout_arm for s in window.samples("q", 1)] == ["", ""]
        # Later records only: each poll reads what was appended since the last.
        more = [record("acme", 20 + i, route="r", route_revision=2, rollout_arm="canary",
                       status=503) for i in range(5)]  # fmt: skip
        for r in more:
            await writer.append(r)
        await window.advance(60.0, now + 1)
        assert window.records_read == 14
        await window.advance(60.0, now + 2)
        assert window.records_read == 14  # nothing new: nothing read again
        got = window.samples("r", 2)
        assert len(got) == 9
        assert [s.status for s in got if s.rollout_arm == "canary"] == [503] * 5
        # Time passes: the horizon forgets the older ones.
        await window.advance(60.0, now + 58)
        assert len(window.samples("r", 2)) == 5
        assert len(window) == 5 + 2
        # A longer horizon starts the window again, one scan back that far.
        await window.advance(3600.0, now + 58)
        assert window.records_read == 14
        assert len(window.samples("r", 2)) == 3 + 4 + 5
        assert await consumers(bus.js) == 1  # one standing read, whatever the polls
    finally:
        await window.aclose()
    assert await consumers(bus.js) == 0


async def test_a_lost_follower_starts_the_window_again(bus: Bus) -> None:
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    await writer.append(record("acme", 0, route="r"))
    window = LedgerWindow(reader)
    try:
        await window.advance(60.0)
        assert window.records_read == 1
        follow = window._follow
        assert follow is not None
        await bus.js.delete_consumer(STREAM, follow.name)  # as after inactivity or a restart
        await writer.append(record("acme", 1, route="r"))
        with pytest.raises(LedgerFollowLost):
            await window.advance(60.0)
        await window.advance(60.0)  # the next round: one scan back, nothing lost
        assert window.records_read == 2
        assert len(window.samples("r", 3)) == 2
    finally:
        await window.aclose()

"""Ports the fleet hands its children (jetserve/services.py): below the kernel's
ephemeral range, where no outgoing connection can take one between the pick and
the child's bind, and never the same one twice from one process."""

from __future__ import annotations

import socket

from jetserve.services import _ephemeral_low, free_port, free_ports


def test_picked_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = _ephemeral_low()
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(1024 < p < low for p in picked)
    with socket.socket() as s:  # free when handed out
        s.bind(("127.0.0.1", picked[-1]))


def test_a_run_of_ports_fits_below_the_range_and_does_not_overlap_the_next_pick() -> None:
    base = free_ports(8)
    after = free_port()
    assert base + 8 <= _ephemeral_low()
    assert not base <= after < base + 8

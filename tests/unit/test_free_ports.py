"""Ports the fleet hands its children (jetserve/services.py): below the kernel's
ephemeral range, where no outgoing connection can take one between the pick and
the child's bind, never the same one twice from one process, and, for processes
confined to shares of the range (the suite's parallel workers), never one
another's."""

from __future__ import annotations

import socket

import pytest

from jetserve.services import _ephemeral_low, _PortPicker, free_port, free_ports


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


def test_pickers_confined_to_different_shares_never_pick_the_same_port() -> None:
    low, top = _PortPicker.LOW, _ephemeral_low()
    shares = [_PortPicker() for _ in range(3)]
    picked: list[set[int]] = []
    for i, picker in enumerate(shares):
        picker.confine(i, len(shares))
        # More picks than a share holds: each wraps around within its own share.
        runs = [picker.take(8) for _ in range((top - low) // 8)]
        picked.append({base + k for base in runs for k in range(8)})
    for i, ports in enumerate(picked):
        assert all(low <= p < top for p in ports)
        assert all(not ports & other for other in picked[i + 1 :])
    with pytest.raises(ValueError, match="share 3 of 3"):
        _PortPicker().confine(3, 3)

"""Every test runs with least-privilege bus credentials: a permission violation
that nats-server logged means a role is missing a grant (streams/auth.py),
unless the test tried it on purpose (marker ``bus_refusals``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from jetserve.fleet import Fleet, FleetSpec


def assert_no_refusals(request: pytest.FixtureRequest, violations: list[str]) -> None:
    if request.node.get_closest_marker("bus_refusals") is None:
        assert not violations, "the bus refused a role:\n" + "\n".join(violations[:10])


@contextmanager
def checked_fleet(request: pytest.FixtureRequest, spec: FleetSpec) -> Iterator[Fleet]:
    """A fleet for a fixture; after it stops, no refusal may be in its bus's log."""
    with Fleet(spec) as fleet:
        yield fleet
    assert_no_refusals(request, fleet.violations())

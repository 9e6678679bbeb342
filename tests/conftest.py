"""Shared fixtures: real nats-server / redis-server processes on free ports, and
whole fleets (simulator, gateway, workers) as real processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from jetserve.fleet import Fleet, FleetSpec
from jetserve.services import Service, start_nats, start_redis


@pytest.fixture
def nats_server() -> Iterator[Service]:
    svc = start_nats()
    yield svc
    svc.stop()


@pytest.fixture
def redis_server() -> Iterator[Service]:
    svc = start_redis()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """One fleet shared by a module's read-only tests: fast simulator, 2 workers."""
    with Fleet(FleetSpec(workers=2, profile="fast")) as f:
        yield f


@pytest.fixture
def make_fleet() -> Iterator[Callable[..., Fleet]]:
    """Fleets a test may break (kill workers, stop services): torn down after it."""
    made: list[Fleet] = []

    def make(**kwargs: object) -> Fleet:
        f = Fleet(FleetSpec(**kwargs))  # type: ignore[arg-type]
        made.append(f)
        return f.start()

    yield make
    for f in made:
        f.stop()

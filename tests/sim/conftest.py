"""Fixtures: `start_sim(**SimConfig fields)` and `fast` (a zero-latency simulator)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest

from sim.clock import Clock
from sim.config import SimConfig
from tests.sim.simkit import SimHandle, StartSim, serve


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """`await start_sim(profile="fast", max_num_seqs=2)`: a served simulator;
    `clock=VirtualClock()` runs its engine in model time."""
    async with AsyncExitStack() as stack:

        async def start(clock: Clock | None = None, **kw: Any) -> SimHandle:
            return await stack.enter_async_context(serve(SimConfig(**kw), clock))

        yield start


@pytest.fixture
async def fast(start_sim: StartSim) -> SimHandle:
    return await start_sim(profile="fast")

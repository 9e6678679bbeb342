"""`jetserve bench embed`'s closed loop, against the simulator's /v1/embeddings:
both load generators count the inputs each answer carried, and a refusal is an
error, not an item."""

from __future__ import annotations

import pytest

from jetserve.bench.embed import bodies, closed_loop
from tests.sim.simkit import SimHandle


@pytest.mark.parametrize("kind", ["lean", "httpx"])
async def test_the_loop_counts_the_items_of_each_answer(fast: SimHandle, kind: str) -> None:
    lat, items, errors = await closed_loop(
        fast.url, {}, bodies("sim-embed", 8, seed=1), clients=2, warmup=0.0, duration=1.0,
        client_kind=kind,
    )  # fmt: skip
    assert errors == 0
    assert lat
    assert items == 8 * len(lat)


async def test_a_refused_request_counts_as_an_error(fast: SimHandle) -> None:
    # An empty input list is a 400 from the engine: no items, one error each.
    bad = iter(lambda: b'{"model": "sim-embed", "input": []}', None)
    lat, items, errors = await closed_loop(fast.url, {}, bad, 1, 0.0, 0.5)
    assert (lat, items) == ([], 0)
    assert errors > 0


async def test_a_pause_spaces_the_requests_and_ends_with_the_window(fast: SimHandle) -> None:
    # Pauses of a 1000 s mean (the seeded draws are far past the window): each
    # client sends one request, then pauses to the window's end, not beyond it.
    lat, items, errors = await closed_loop(
        fast.url, {}, bodies("sim-embed", 1, seed=1), clients=3, warmup=0.0, duration=2.0,
        pause_s=1000.0,
    )  # fmt: skip
    assert errors == 0
    assert items == len(lat) == 3  # one request per client: the loop ended at the window

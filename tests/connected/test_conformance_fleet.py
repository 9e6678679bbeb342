"""The whole conformance corpus through a real fleet (gateway, bus, worker, the
simulator as engine): what the engine answers reaches the client as the engine
would answer directly, streamed (the OpenAI adapter reads the gateway's SSE) and
whole (``stream: false``). One fleet serves every case."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from jetserve.conformance.corpus import CASES
from jetserve.conformance.report import Report, Status
from jetserve.conformance.runner import run_corpus
from jetserve.conformance.whole import WholeReplies
from jetserve.fleet import Fleet, FleetSpec
from tests.refusals import checked_fleet
from tests.waits import until
from workers.engines.base import EngineAdapter
from workers.engines.openai import OpenAIAdapter

pytestmark = pytest.mark.connected


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    with checked_fleet(request, FleetSpec(workers=1, profile="fast")) as f:
        yield f


async def _engine_idle(fleet: Fleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.sim_url, timeout=5.0) as c:

        async def idle() -> bool:
            stats = (await c.get("/sim/stats")).json()
            return bool(stats["running"] == 0 and stats["waiting"] == 0)

        await until(idle, "the engine to finish the corpus's requests")


def _assert_carried(report: Report) -> None:
    assert report.silent_drops == [], report.to_markdown()
    assert report.failures == [], report.to_markdown()
    # The relay adds no loss of its own: every case passes as it does directly (the
    # OpenAI adapter's own translation, where the client side is that adapter: vLLM's
    # guided_* fields as structured_outputs).
    changed = {r.case: r.status for r in report.rows if r.status is not Status.PASSED}
    moved = {"guided_json", "guided_choice", "structured_outputs_json"}
    assert set(changed) <= moved, changed
    assert set(changed.values()) <= {Status.TRANSFORMED}


async def _run(fleet: Fleet, adapter: EngineAdapter, dialect: str, skip: set[str]) -> Report:
    cases = [c for c in CASES if c.name not in skip]
    async with adapter:
        report = await run_corpus(
            adapter, engine_url=fleet.sim_url, dialect=dialect, model="sim-8b", cases=cases
        )
    await _engine_idle(fleet)
    return report


async def test_corpus_streamed_through_the_fleet(fleet: Fleet) -> None:
    adapter = OpenAIAdapter(fleet.base_url, api_key=fleet.api_key)
    report = await _run(fleet, adapter, "gateway (streamed)", set())
    _assert_carried(report)
    assert len(report.rows) == len(CASES)


async def test_corpus_whole_through_the_fleet(fleet: Fleet) -> None:
    # A whole reply cannot be cancelled mid-answer.
    adapter = WholeReplies(fleet.base_url, api_key=fleet.api_key)
    report = await _run(fleet, adapter, "gateway (whole)", {"cancellation"})
    _assert_carried(report)
    assert len(report.rows) == len(CASES) - 1

"""The conformance corpus against all three adapters, on the real simulator."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from jetserve.conformance.corpus import CASES
from jetserve.conformance.report import Report, Status, matrix_markdown
from jetserve.conformance.runner import run_corpus
from streams.wire import Op
from tests.sim.simkit import SimHandle
from workers.engines import translation as t
from workers.engines.base import Delta, Done
from workers.engines.factory import make_adapter
from workers.engines.tgi import TGIAdapter

EXPECTED: dict[str, dict[str, Status]] = {
    "openai": {row: Status.PASSED for row in t.ROWS},
    "tgi": {
        t.MESSAGES: Status.TRANSFORMED,
        t.MAX_TOKENS: Status.TRANSFORMED,
        t.TOOLS: Status.EMULATED,
        t.RESPONSE_FORMAT: Status.TRANSFORMED,
        t.STOP: Status.TRANSFORMED,
        t.USAGE: Status.TRANSFORMED,
        t.CANCELLATION: Status.PASSED,
        t.ERR_CONTEXT: Status.TRANSFORMED,
        t.ERR_429: Status.TRANSFORMED,
        t.ERR_5XX: Status.PASSED,
        t.ERR_MALFORMED: Status.PASSED,
    },
    "triton": {
        t.MESSAGES: Status.TRANSFORMED,
        t.MAX_TOKENS: Status.PASSED,
        t.TOOLS: Status.REJECTED,
        t.RESPONSE_FORMAT: Status.REJECTED,
        t.STOP: Status.PASSED,
        t.USAGE: Status.TRANSFORMED,
        t.CANCELLATION: Status.PASSED,
        t.ERR_CONTEXT: Status.TRANSFORMED,
        t.ERR_429: Status.TRANSFORMED,
        t.ERR_5XX: Status.PASSED,
        t.ERR_MALFORMED: Status.PASSED,
    },
}


async def _idle(sim: SimHandle) -> None:
    """Requests cut by the client end asynchronously in the engine; wait for them."""
    for _ in range(200):
        stats = await sim.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {stats}")


@pytest.mark.parametrize("dialect", ["openai", "tgi", "triton"])
async def test_corpus_per_adapter(fast: SimHandle, dialect: str) -> None:
    async with make_adapter(dialect, fast.url, model="sim-8b") as adapter:
        report = await run_corpus(adapter, engine_url=fast.url, dialect=dialect)
    await _idle(fast)
    assert report.silent_drops == [], report.to_markdown()
    assert report.failures == [], report.to_markdown()
    assert {r.field: r.status for r in report.rows} == EXPECTED[dialect], report.to_markdown()
    # Every row is explained unless it is a plain pass-through.
    assert all(r.note for r in report.rows if r.status is not Status.PASSED)
    assert json.loads(json.dumps(report.to_json()))["ok"] is True
    stats = await fast.stats()
    assert stats["aborted"] >= 1  # the cancellation case reached the engine as an abort


async def test_real_engine_mode_marks_fault_cases_not_applicable(fast: SimHandle) -> None:
    async with make_adapter("tgi", fast.url) as adapter:
        report = await run_corpus(
            adapter, engine_url=fast.url, dialect="tgi", faults_supported=False
        )
    await _idle(fast)
    na = {r.field for r in report.rows if r.status is Status.NOT_APPLICABLE}
    assert na == {t.ERR_429, t.ERR_5XX, t.ERR_MALFORMED}
    assert report.silent_drops == [], report.to_markdown()
    assert report.failures == [], report.to_markdown()
    # Without /sim/stats, cancellation is judged by TGI's batch gauge returning to 0.
    assert report.status(t.CANCELLATION) is Status.PASSED


class _DropsStop(TGIAdapter):
    """A buggy adapter: claims `stop` is carried but never sends it."""

    def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        return super().generate(op, {**body, "stop": None}, request_id, headers)


class _DropsTools(TGIAdapter):
    def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        trimmed = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
        return super().generate(op, trimmed, request_id, headers)


@pytest.mark.parametrize(("cls", "row"), [(_DropsStop, t.STOP), (_DropsTools, t.TOOLS)])
async def test_runner_catches_a_silent_drop(
    fast: SimHandle, cls: type[TGIAdapter], row: str
) -> None:
    cases = [c for c in CASES if c.row == row]
    async with cls(fast.url) as adapter:
        report = await run_corpus(adapter, engine_url=fast.url, dialect="tgi", cases=cases)
    assert [r.field for r in report.silent_drops] == [row]
    assert report.status(row) is Status.DROPPED
    assert "**DROPPED**" in report.to_markdown()


async def test_matrix_lists_every_adapter(fast: SimHandle) -> None:
    reports: list[Report] = []
    cases = [c for c in CASES if c.row in (t.MESSAGES, t.TOOLS)]
    for dialect in ("openai", "tgi", "triton"):
        async with make_adapter(dialect, fast.url, model="sim-8b") as adapter:
            reports.append(
                await run_corpus(adapter, engine_url=fast.url, dialect=dialect, cases=cases)
            )
    table = matrix_markdown(reports)
    assert table.splitlines()[0] == "| field | openai | tgi | triton |"
    assert "| `tools` | passed | emulated | rejected |" in table


@pytest.mark.parametrize(
    ("reply", "status"),
    [
        ('{"city": "Paris", "temp_c": 2', Status.PASSED),  # the grammar held, cut short
        ("Sure, the weather in Paris is fine today", Status.DROPPED),  # format ignored
    ],
)
async def test_a_json_reply_cut_at_max_tokens_is_no_silent_drop(
    fast: SimHandle, reply: str, status: Status
) -> None:
    # A random-weight model under a JSON grammar rarely closes the object in time:
    # valid JSON so far, ended by `length`, means the engine applied the format.
    base = next(c for c in CASES if c.name == "json_mode")
    words = len(reply.split())  # the simulator's tokens are words
    case = dataclasses.replace(
        base,
        body={**base.body, "max_tokens": words - 1},
        sim_script={"content": reply + " and more words after it"},
    )
    async with make_adapter("openai", fast.url, model="sim-8b") as adapter:
        report = await run_corpus(adapter, engine_url=fast.url, dialect="openai", cases=[case])
    row = report.rows[0]
    assert row.status is status, row
    if status is Status.PASSED:
        assert "cut at max_tokens" in row.note

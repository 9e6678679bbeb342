"""The conformance corpus against all three adapters, on the real simulator: nothing
is dropped silently, and the committed reports (docs/conformance.md) are current."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from jetserve.conformance.corpus import CASES
from jetserve.conformance.publish import run_dialects
from jetserve.conformance.report import Report, Status, matrix_markdown
from jetserve.conformance.runner import run_corpus
from streams.wire import Op
from tests.sim.simkit import SimHandle
from workers.engines import translation as t
from workers.engines.base import Delta, Done, EngineAdapter
from workers.engines.factory import make_adapter
from workers.engines.openai import OpenAIAdapter
from workers.engines.tgi import TGIAdapter
from workers.engines.triton import TritonAdapter

DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"
FAULT_CASES = {"rate_limited", "server_error", "server_error_500", "malformed_chunk"}


async def _idle(sim: SimHandle) -> None:
    """Requests cut by the client end asynchronously in the engine; wait for them."""
    for _ in range(200):
        stats = await sim.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {stats}")


def _committed() -> dict[str, dict[str, str]]:
    """docs/conformance.md's case table: case -> dialect -> status."""
    lines = [ln for ln in DOC.read_text().splitlines() if ln.startswith("| ")]
    head = next(ln for ln in lines if ln.startswith("| case |"))
    dialects = [c.strip() for c in head.strip("|").split("|")][2:]
    table: dict[str, dict[str, str]] = {}
    for ln in lines[lines.index(head) + 1 :]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if len(cells) != len(dialects) + 2 or set(cells[0]) <= {"-"}:
            continue
        table[cells[0]] = dict(zip(dialects, cells[2:], strict=True))
    return table


async def test_corpus_through_every_adapter(fast: SimHandle) -> None:
    assert len(CASES) >= 40
    reports = await run_dialects(fast.url)
    await _idle(fast)
    for report in reports:
        assert report.silent_drops == [], report.to_markdown()
        assert report.failures == [], report.to_markdown()
        # Every row is explained unless it is a plain pass-through.
        assert all(r.note for r in report.rows if r.status is not Status.PASSED)
        assert json.loads(json.dumps(report.to_json()))["ok"] is True
    openai, tgi, triton = reports
    # The OpenAI adapter passes everything through, but vLLM's guided_* fields go as
    # structured_outputs (vLLM 0.32 ignores them: the real-vLLM tier showed it).
    moved = {"guided_json", "guided_choice", "structured_outputs_json"}
    assert {r.status for r in openai.rows if r.case not in moved} == {Status.PASSED}
    assert {openai.status(c) for c in moved} == {Status.TRANSFORMED}
    assert tgi.status("parallel_tool_calls_false") is Status.EMULATED
    assert triton.status("tool_choice_none") is Status.EMULATED
    # What the engine lacks is refused, what it has is carried (issue 17).
    assert tgi.status("presence_penalty") is Status.REJECTED
    assert tgi.status("frequency_penalty") is Status.PASSED
    assert triton.status("logit_bias") is Status.REJECTED
    for case in ("top_k", "logprobs", "n_chat", "best_of", "echo", "guided_choice"):
        assert tgi.status(case) is not Status.REJECTED, case
        assert triton.status(case) is not Status.REJECTED, case
    # The committed report is what the corpus gives today (`make conformance-report`).
    assert matrix_markdown(reports) in DOC.read_text(), "run make conformance-report"
    committed = _committed()
    assert set(committed) == {c.name for c in CASES}
    stats = await fast.stats()
    assert stats["aborted"] >= 3  # each cancellation case reached the engine as an abort


async def test_real_engine_mode_marks_fault_cases_not_applicable(fast: SimHandle) -> None:
    async with make_adapter("tgi", fast.url) as adapter:
        report = await run_corpus(
            adapter, engine_url=fast.url, dialect="tgi", faults_supported=False
        )
    await _idle(fast)
    na = {r.case for r in report.rows if r.status is Status.NOT_APPLICABLE}
    # The fault cases, and what TGI's API cannot express (declared by the adapter).
    assert na == FAULT_CASES | {"cached_tokens", "unknown_model"}
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
    assert [r.field for r in report.silent_drops] == [row] * len(cases)
    assert report.status(row) is Status.DROPPED
    assert "**DROPPED**" in report.to_markdown()


# Each case, and the request field whose loss it must catch. (best_of is carried but
# shows nothing on the simulator; tool_choice "auto" is the default anyway.)
DROPPABLE: dict[str, str | tuple[str, ...]] = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_completion_tokens",
    "completion_length": "max_tokens",
    "stop_sequences": "stop",
    "stop_array": "stop",
    "completion_stop": "stop",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens",
    "tool_calls": ("tools", "tool_choice"),  # a named choice without tools is a 400
    "parallel_tool_calls": "tools",
    "tool_choice_required": "tool_choice",
    "tool_choice_named": "tool_choice",
    "tool_choice_none": "tool_choice",
    "parallel_tool_calls_false": "parallel_tool_calls",
    "json_mode": "response_format",
    "json_object": "response_format",
    "guided_json": "guided_json",
    "structured_outputs_json": "structured_outputs",
    "guided_choice": "guided_choice",
    "seed": "seed",
    "temperature_zero": "temperature",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "completion_logprobs": "logprobs",
    "n_chat": "n",
    "n_completion": "n",
    "echo": "echo",
    "unknown_model": "model",
}


class _Drops:
    """A bug to mix into an adapter (before it in the bases): it leaves
    ``fields`` out of every request."""

    fields: tuple[str, ...] = ()

    def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        trimmed = {k: v for k, v in body.items() if k not in self.fields}
        adapter = cast(EngineAdapter, super())  # the adapter it is mixed into
        return adapter.generate(op, trimmed, request_id, headers)


class _DropsOne(_Drops, OpenAIAdapter):
    """A buggy pass-through adapter: leaves one field out of every request."""


async def test_every_case_catches_the_loss_of_its_field(fast: SimHandle) -> None:
    """The simulator applies each field visibly, so each case is a real check: with
    its field left out, the case reports a silent drop."""
    missed = []
    for name, field in DROPPABLE.items():
        case = next(c for c in CASES if c.name == name)
        adapter = _DropsOne(fast.url)
        adapter.fields = (field,) if isinstance(field, str) else field
        async with adapter:
            report = await run_corpus(adapter, engine_url=fast.url, dialect="x", cases=[case])
        if report.rows[0].status is not Status.DROPPED:
            missed.append((name, field, report.rows[0].status, report.rows[0].note))
    assert missed == []


async def test_matrix_lists_every_adapter(fast: SimHandle) -> None:
    reports: list[Report] = []
    cases = [c for c in CASES if c.row in (t.MESSAGES, t.TOOLS)]
    for dialect in ("openai", "tgi", "triton"):
        async with make_adapter(dialect, fast.url, model="sim-8b") as adapter:
            reports.append(
                await run_corpus(adapter, engine_url=fast.url, dialect=dialect, cases=cases)
            )
    table = matrix_markdown(reports)
    assert table.splitlines()[0] == "| case | field | openai | tgi | triton |"
    assert "| tool_calls | `tools` | passed | emulated | emulated |" in table


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
    words = len(re.findall(r"\s*\w+|\s*[^\w\s]", reply))  # the simulator's tokens
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


class _TgiDropsOne(_Drops, TGIAdapter):
    """A buggy TGI adapter: leaves one field out of every request."""


class _TritonDropsOne(TritonAdapter):
    fields: tuple[str, ...] = ()

    def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        trimmed = {k: v for k, v in body.items() if k not in self.fields}
        return super().generate(op, trimmed, request_id, headers)


_CARRIED = {Status.PASSED, Status.TRANSFORMED, Status.EMULATED}


@pytest.mark.parametrize("dialect", ["tgi", "triton"])
async def test_prompted_dialects_honour_what_they_carry(fast: SimHandle, dialect: str) -> None:
    """Each field the TGI or Triton adapter carries reaches the engine's native API and
    the simulator's dialect applies it: the same adapter with that field left out turns
    the case into a silent drop."""
    missed, carried = [], []
    for name, field in DROPPABLE.items():
        case = next(c for c in CASES if c.name == name)
        adapter = (
            _TgiDropsOne(fast.url)
            if dialect == "tgi"
            else _TritonDropsOne(fast.url, model="sim-8b")
        )
        async with adapter:
            whole = await run_corpus(adapter, engine_url=fast.url, dialect=dialect, cases=[case])
            if whole.rows[0].status not in _CARRIED:
                continue
            carried.append(name)
            adapter.fields = (field,) if isinstance(field, str) else field
            report = await run_corpus(adapter, engine_url=fast.url, dialect=dialect, cases=[case])
        if report.rows[0].status is not Status.DROPPED:
            missed.append((name, field, report.rows[0].status, report.rows[0].note))
    await _idle(fast)
    assert missed == []
    assert len(carried) >= 25

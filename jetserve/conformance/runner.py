"""Run the conformance corpus against one engine adapter and classify every field.

Usage (stable API)::

    from jetserve.conformance.runner import run_corpus
    report = await run_corpus(adapter, engine_url="http://127.0.0.1:8000", dialect="openai")
    assert not report.silent_drops, report.to_markdown()

For each case the runner reads the adapter's claim for the case's row
(``workers.engines.translation.declared``: passed / transformed / emulated / rejected),
runs the request through ``adapter.generate`` and checks the behaviour:

- claimed *rejected*: the adapter must raise ``EngineRejected`` (else ``failed``);
- claimed carried: the effect must show in the output (stop string absent, a structured
  tool call, JSON, token counts...); a request that succeeds without the effect is a
  **silent drop** (``dropped``) and ends up in ``report.silent_drops``;
- error cases: the adapter must raise the expected ``workers.errors`` class; a swallowed
  error is a silent drop, a different class is ``failed``.

``faults_supported=True`` means the engine is the jetserve simulator: the runner sends
``X-Sim-Fault`` / ``X-Sim-Script`` headers, installs ``/sim/scripts`` rules and reads
``/sim/stats`` and ``/sim/requests/{id}``. With ``faults_supported=False`` (a real vLLM,
TGI or Triton) the fault cases (429, 5xx, malformed chunk) are ``not_applicable``, the
other checks are the model-independent ones, and cancellation is judged by the
adapter's ``load().running`` going back to zero (``not_applicable`` if unknown).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from jetserve.conformance.corpus import CASES, Case, Check
from jetserve.conformance.json_prefix import is_json_prefix
from jetserve.conformance.report import Report, Row, Status
from workers import errors
from workers.engines.base import Delta, Done, EngineAdapter
from workers.engines.translation import FieldStatus, declared

_CARRIED = {
    FieldStatus.PASSED: Status.PASSED,
    FieldStatus.TRANSFORMED: Status.TRANSFORMED,
    FieldStatus.EMULATED: Status.EMULATED,
}


class CheckFailed(Exception):
    """The request succeeded but the field's effect is missing."""


class CutShort(Exception):
    """The field's effect is there but the reply was cut at max_tokens (a JSON
    reply that is valid so far): carried, with a note."""


@dataclass
class Outcome:
    text: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    done: Done | None = None
    deltas: int = 0


async def run_corpus(
    adapter: EngineAdapter,
    *,
    engine_url: str,
    dialect: str,
    faults_supported: bool = True,
    cases: Sequence[Case] = CASES,
    timeout_s: float = 15.0,
) -> Report:
    report = Report(adapter=type(adapter).__name__, dialect=dialect, engine_url=engine_url)
    async with httpx.AsyncClient(base_url=engine_url.rstrip("/"), timeout=5.0) as probe:
        run = _Run(adapter, probe, faults_supported, uuid.uuid4().hex[:8], timeout_s)
        for case in cases:
            report.rows.append(await run.case(case))
    return report


class _Run:
    def __init__(
        self,
        adapter: EngineAdapter,
        probe: httpx.AsyncClient,
        sim: bool,
        nonce: str,
        timeout_s: float,
    ) -> None:
        self.adapter = adapter
        self.probe = probe  # talks to the simulator's /sim routes
        self.sim = sim
        self.nonce = nonce
        self.timeout_s = timeout_s

    def fill(self, value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{nonce}", self.nonce)
        if isinstance(value, list):
            return [self.fill(v) for v in value]
        if isinstance(value, dict):
            return {k: self.fill(v) for k, v in value.items()}
        return value

    async def case(self, case: Case) -> Row:
        claim = declared(self.adapter, case.row)
        if case.needs_sim and not self.sim:
            return Row(case.row, case.name, Status.NOT_APPLICABLE, "needs the simulator's faults")
        body: dict[str, Any] = self.fill(case.body)
        headers = await self._sim_setup(case)
        request_id = f"conf-{self.nonce}-{case.name}"
        try:
            if case.check is Check.CANCEL:
                return await self._cancel(case, body, request_id, headers, claim.note)
            outcome = await asyncio.wait_for(
                self._collect(body, request_id, headers), self.timeout_s
            )
        except errors.EngineError as exc:
            return self._on_error(case, claim.status, claim.note, exc)
        except TimeoutError:
            return Row(case.row, case.name, Status.FAILED, f"no answer in {self.timeout_s:g}s")
        if claim.status is FieldStatus.REJECTED:
            return Row(case.row, case.name, Status.FAILED, "claimed rejected, but was accepted")
        if case.check is Check.ERROR:
            return Row(
                case.row,
                case.name,
                Status.DROPPED,
                f"expected {case.error}, the request succeeded (error swallowed)",
            )
        try:
            await self._verify(case, outcome, request_id)
        except CutShort as exc:
            return Row(case.row, case.name, _CARRIED[claim.status], str(exc))
        except CheckFailed as exc:
            return Row(case.row, case.name, Status.DROPPED, str(exc))
        return Row(case.row, case.name, _CARRIED[claim.status], claim.note)

    def carried(self, case: Case) -> Status:
        return _CARRIED.get(declared(self.adapter, case.row).status, Status.PASSED)

    def _on_error(
        self, case: Case, claimed: FieldStatus, claimed_note: str, exc: errors.EngineError
    ) -> Row:
        name = type(exc).__name__
        if case.check is Check.ERROR:
            if name == case.error:
                status = _CARRIED.get(claimed, Status.PASSED)
                note = claimed_note or f"{name} ({exc.status}): {exc.message[:80]}"
                return Row(case.row, case.name, status, note)
            return Row(case.row, case.name, Status.FAILED, f"expected {case.error}, got {name}")
        if isinstance(exc, errors.EngineRejected):
            # A clear refusal (by the adapter or the engine) is never a silent drop.
            note = exc.message if claimed is FieldStatus.REJECTED else f"undeclared: {exc.message}"
            return Row(case.row, case.name, Status.REJECTED, note)
        return Row(case.row, case.name, Status.FAILED, f"{name}: {exc.message}")

    async def _sim_setup(self, case: Case) -> dict[str, str]:
        if not self.sim:
            return {}
        headers = {"X-Sim-Fault": "none"}  # opt out of the simulator's random faults
        if case.fault is not None:
            headers["X-Sim-Fault"] = case.fault
        elif case.sim_slow_ms is not None:
            headers["X-Sim-Fault"] = f"slow:{case.sim_slow_ms}"
        if case.sim_script is not None:
            headers["X-Sim-Script"] = json.dumps(self.fill(case.sim_script))
        if case.sim_rules:
            r = await self.probe.post(
                "/sim/scripts", params={"append": "true"}, json=self.fill(case.sim_rules)
            )
            r.raise_for_status()
        return headers

    async def _collect(
        self, body: dict[str, Any], request_id: str, headers: dict[str, str]
    ) -> Outcome:
        out = Outcome()
        async for ev in self.adapter.generate("chat", body, request_id, headers):
            if isinstance(ev, Delta):
                out.deltas += 1
                out.text += ev.text
                for call in ev.tool_calls or []:
                    _merge_call(out.tool_calls, call)
            else:
                out.done = ev
        return out

    async def _verify(self, case: Case, out: Outcome, request_id: str) -> None:
        done = out.done
        if done is None:
            raise CheckFailed("no Done event")
        exp = self.fill(case.expect)
        if case.check is Check.TEXT:
            if not out.text or done.finish_reason not in ("stop", "length"):
                raise CheckFailed(f"no text or odd finish {done.finish_reason!r}")
        elif case.check is Check.LENGTH:
            limit = exp["max_tokens"]
            if done.usage.completion_tokens > limit:
                raise CheckFailed(f"{done.usage.completion_tokens} tokens > max_tokens {limit}")
            if self.sim and done.finish_reason != "length":
                raise CheckFailed(f"finish_reason {done.finish_reason!r}, expected 'length'")
        elif case.check is Check.TOOL_CALL:
            calls = list(out.tool_calls.values())
            if not calls or calls[0].get("name") != exp["name"]:
                raise CheckFailed(f"no structured call to {exp['name']}; text {out.text[:80]!r}")
            try:
                args = json.loads(calls[0].get("arguments") or "null")
            except ValueError as exc:
                raise CheckFailed(f"tool arguments are not JSON: {exc}") from exc
            if self.sim and args != exp["arguments"]:
                raise CheckFailed(f"tool arguments {args!r} != {exp['arguments']!r}")
            # A forced (named) tool_choice may end "stop", as OpenAI's own API
            # does for a forced function; the structured call is what counts.
            forced = isinstance(case.body.get("tool_choice"), dict)
            if done.finish_reason != "tool_calls" and not (forced and done.finish_reason == "stop"):
                raise CheckFailed(f"finish_reason {done.finish_reason!r}, expected 'tool_calls'")
        elif case.check is Check.JSON:
            try:
                value = json.loads(out.text)
            except ValueError as exc:
                if done.finish_reason == "length" and is_json_prefix(out.text):
                    # The grammar held; the model did not close the object in time.
                    raise CutShort(
                        "cut at max_tokens as valid JSON so far: the engine applied the "
                        "format, the model did not close it"
                    ) from exc
                raise CheckFailed(f"reply is not JSON: {out.text[:80]!r}") from exc
            if not isinstance(value, dict) or any(k not in value for k in exp["keys"]):
                raise CheckFailed(f"JSON lacks keys {exp['keys']}: {out.text[:80]!r}")
        elif case.check is Check.STOP:
            if exp["stop"] in out.text:
                raise CheckFailed(f"stop string {exp['stop']!r} in the reply")
            if self.sim and out.text != exp["sim_text"]:
                raise CheckFailed(f"reply {out.text!r}, expected {exp['sim_text']!r}")
            if self.sim and done.finish_reason != "stop":
                raise CheckFailed(f"finish_reason {done.finish_reason!r}, expected 'stop'")
        elif case.check is Check.USAGE:
            u = done.usage
            if u.prompt_tokens <= 0 or u.completion_tokens <= 0:
                raise CheckFailed(f"usage missing: {u.prompt_tokens}/{u.completion_tokens}")
            if self.sim:
                rec = await self._record(request_id)
                seen = (rec["prompt_tokens"], rec["generated_tokens"])
                if (u.prompt_tokens, u.completion_tokens) != seen:
                    raise CheckFailed(f"usage {u.prompt_tokens}/{u.completion_tokens} != {seen}")

    async def _record(self, request_id: str) -> dict[str, Any]:
        r = await self.probe.get(f"/sim/requests/{request_id}")
        r.raise_for_status()
        return dict(r.json())

    async def _cancel(
        self,
        case: Case,
        body: dict[str, Any],
        request_id: str,
        headers: dict[str, str],
        note: str,
    ) -> Row:
        first = asyncio.Event()

        async def consume() -> None:
            async for ev in self.adapter.generate("chat", body, request_id, headers):
                if isinstance(ev, Delta) and ev.text:
                    first.set()

        task = asyncio.create_task(consume())
        try:
            waiter = asyncio.create_task(first.wait())
            await asyncio.wait(
                {task, waiter}, timeout=self.timeout_s, return_when="FIRST_COMPLETED"
            )
            waiter.cancel()
            if task.done():
                task.result()  # an EngineError propagates to case()
                return Row(case.row, case.name, Status.FAILED, "finished before it was cancelled")
            if not first.is_set():
                return Row(case.row, case.name, Status.FAILED, "no first token to cancel after")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.sim:
            return await self._aborted_in_sim(case, request_id, note)
        return await self._idle_by_load(case, note)

    async def _aborted_in_sim(self, case: Case, request_id: str, note: str) -> Row:
        rec: dict[str, Any] = {}
        for _ in range(200):  # the engine notices the closed connection asynchronously
            rec = await self._record(request_id)
            if rec["status"] == "aborted":
                stats = (await self.probe.get("/sim/stats")).json()
                return Row(
                    case.row,
                    case.name,
                    Status.PASSED,
                    note
                    or f"engine aborted after {rec['generated_tokens']} tokens; "
                    f"sim aborted={stats['aborted']}",
                )
            await asyncio.sleep(0.01)
        return Row(case.row, case.name, Status.DROPPED, f"engine kept the request: {rec['status']}")

    async def _idle_by_load(self, case: Case, note: str) -> Row:
        for _ in range(100):
            load = await self.adapter.load()
            if load.running is None:
                return Row(case.row, case.name, Status.NOT_APPLICABLE, "engine reports no load")
            if load.running == 0:
                status = self.carried(case)
                return Row(case.row, case.name, status, note or "engine idle after cancel")
            await asyncio.sleep(0.05)
        return Row(case.row, case.name, Status.DROPPED, "engine still running after cancel")


def _merge_call(calls: dict[int, dict[str, str]], delta: dict[str, Any]) -> None:
    """OpenAI streams a call in pieces: id and name first, then argument fragments."""
    index = int(delta.get("index", len(calls)))
    slot = calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
    if delta.get("id"):
        slot["id"] = str(delta["id"])
    fn = delta.get("function") or {}
    if fn.get("name"):
        slot["name"] = str(fn["name"])
    if fn.get("arguments"):
        slot["arguments"] += str(fn["arguments"])

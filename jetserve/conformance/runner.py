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

A claim of *not_applicable* (a response detail or error the dialect cannot express)
is reported as such, with the adapter's note, without running the case.

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
import re
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from jetserve.conformance.checks import CHECKS, CaseBroken, CheckFailed, Ctx, CutShort
from jetserve.conformance.corpus import CASES, Case, Check
from jetserve.conformance.outcome import Outcome
from jetserve.conformance.report import Report, Row, Status
from workers import errors
from workers.engines.base import Delta, EngineAdapter
from workers.engines.translation import FieldStatus, declared

_CARRIED = {
    FieldStatus.PASSED: Status.PASSED,
    FieldStatus.TRANSFORMED: Status.TRANSFORMED,
    FieldStatus.EMULATED: Status.EMULATED,
}


async def run_corpus(
    adapter: EngineAdapter,
    *,
    engine_url: str,
    dialect: str,
    faults_supported: bool = True,
    cases: Sequence[Case] = CASES,
    timeout_s: float = 15.0,
    model: str | None = None,
) -> Report:
    """``model``: named in every body that names none (a gateway requires it)."""
    report = Report(adapter=type(adapter).__name__, dialect=dialect, engine_url=engine_url)
    async with httpx.AsyncClient(base_url=engine_url.rstrip("/"), timeout=5.0) as probe:
        run = _Run(adapter, probe, faults_supported, uuid.uuid4().hex[:8], timeout_s, model)
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
        model: str | None = None,
    ) -> None:
        self.adapter = adapter
        self.probe = probe  # talks to the simulator's /sim routes (and /tokenize)
        self.sim = sim
        self.nonce = nonce
        self.timeout_s = timeout_s
        self.token = ""  # the current case's token_word id
        self.model = model

    def fill(self, value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{nonce}", self.nonce).replace("{token}", self.token)
        if isinstance(value, list):
            return [self.fill(v) for v in value]
        if isinstance(value, dict):
            return {self.fill(k): self.fill(v) for k, v in value.items()}
        return value

    async def case(self, case: Case) -> Row:
        claim = declared(self.adapter, case.row)
        if claim.status is FieldStatus.NOT_APPLICABLE:
            return self._row(case, Status.NOT_APPLICABLE, claim.note)
        if case.needs_sim and not self.sim:
            return self._row(case, Status.NOT_APPLICABLE, "needs the simulator's faults")
        if case.token_word is not None:
            self.token = await self._token_id(case.token_word)
        body: dict[str, Any] = self.fill(case.body)
        if self.model is not None:
            body.setdefault("model", self.model)
        headers = await self._sim_setup(case)
        request_id = f"conf-{self.nonce}-{case.name}"
        try:
            if case.check is Check.CANCEL:
                return await self._cancel(case, body, request_id, headers, claim.note)
            outcome = await self._collect(case, body, request_id, headers)
            if claim.status is FieldStatus.REJECTED:
                return self._row(case, Status.FAILED, "claimed rejected, but was accepted")
            if case.check is Check.ERROR:
                note = f"expected {case.error}, the request succeeded (error swallowed)"
                return self._row(case, Status.DROPPED, note)
            await self._verify(case, body, outcome, request_id, headers)
        except errors.EngineError as exc:
            return self._on_error(case, claim.status, claim.note, exc)
        except TimeoutError:
            return self._row(case, Status.FAILED, f"no answer in {self.timeout_s:g}s")
        except CutShort as exc:
            return self._row(case, _CARRIED[claim.status], str(exc))
        except CheckFailed as exc:
            return self._row(case, Status.DROPPED, str(exc))
        except CaseBroken as exc:
            return self._row(case, Status.FAILED, f"the case proves nothing: {exc}")
        return self._row(case, _CARRIED[claim.status], claim.note)

    def _row(self, case: Case, status: Status, note: str = "") -> Row:
        # The run's nonce would make every report differ from the last.
        return Row(case.row, case.name, status, note.replace(self.nonce, "{nonce}"))

    def carried(self, case: Case) -> Status:
        return _CARRIED.get(declared(self.adapter, case.row).status, Status.PASSED)

    def _on_error(
        self, case: Case, claimed: FieldStatus, claimed_note: str, exc: errors.EngineError
    ) -> Row:
        name = type(exc).__name__
        if case.check is Check.ERROR:
            expected = getattr(errors, case.error or "", None)
            status = case.expect.get("status")
            if not (isinstance(expected, type) and isinstance(exc, expected)):
                return self._row(case, Status.FAILED, f"expected {case.error}, got {name}")
            if status is not None and exc.status != status:
                return self._row(case, Status.FAILED, f"expected status {status}, got {exc.status}")
            if not _readable(exc.message, case.expect.get("message")):
                return self._row(case, Status.FAILED, f"message {exc.message[:120]!r}")
            note = claimed_note or f"{name} ({exc.status}): {exc.message[:80]}"
            carried = Status.REJECTED if claimed is FieldStatus.REJECTED else _CARRIED[claimed]
            return self._row(case, carried, note)
        if isinstance(exc, errors.EngineRejected):
            # A clear refusal (by the adapter or the engine) is never a silent drop.
            if claimed is FieldStatus.REJECTED:
                note = claimed_note or exc.message
            else:
                note = f"undeclared: {exc.message}"
            return self._row(case, Status.REJECTED, note)
        return self._row(case, Status.FAILED, f"{name}: {exc.message}")

    async def _token_id(self, word: str) -> str:
        """The engine's id of `word` (the first, if its tokenizer splits it)."""
        r = await self.probe.post("/tokenize", json={"prompt": word, "add_special_tokens": False})
        if r.status_code == 404:  # llama.cpp's server: /extras/tokenize, which adds BOS
            ids = await self._extras_tokens(word)
            return str(ids[len(await self._extras_tokens("")) :][0])
        r.raise_for_status()
        return str(r.json()["tokens"][0])

    async def _extras_tokens(self, text: str) -> list[int]:
        r = await self.probe.post("/extras/tokenize", json={"input": text})
        r.raise_for_status()
        return list(r.json()["tokens"])

    async def _sim_setup(self, case: Case) -> dict[str, str]:
        if not self.sim:
            return {}
        # Opt out of the simulator's random faults; name its record of the request
        # (set per request by _collect).
        headers = {"X-Sim-Fault": "none"}
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
        self, case: Case, body: dict[str, Any], request_id: str, headers: dict[str, str]
    ) -> Outcome:
        if self.sim:
            headers = {**headers, "X-Sim-Request-Id": request_id}

        async def collect() -> Outcome:
            out = Outcome()
            async for ev in self.adapter.generate(case.op, body, request_id, headers):
                if isinstance(ev, Delta):
                    out.add(ev)
                else:
                    out.done = ev
            return out

        return await asyncio.wait_for(collect(), self.timeout_s)

    async def _verify(
        self,
        case: Case,
        body: dict[str, Any],
        out: Outcome,
        request_id: str,
        headers: dict[str, str],
    ) -> None:
        runs = 0

        async def again(changes: dict[str, Any]) -> Outcome:
            nonlocal runs
            runs += 1
            changed = {**body, **changes}
            sent = {k: v for k, v in changed.items() if v is not None}
            return await self._collect(case, sent, f"{request_id}-{runs}", headers)

        async def record() -> dict[str, Any]:
            return await self._record(request_id)

        ctx = Ctx(case, self.fill(case.expect), self.sim, again, record)
        await CHECKS[case.check](ctx, out)

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
        if self.sim:
            headers = {**headers, "X-Sim-Request-Id": request_id}

        async def consume() -> None:
            async for ev in self.adapter.generate(case.op, body, request_id, headers):
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
                return self._row(case, Status.FAILED, "finished before it was cancelled")
            if not first.is_set():
                return self._row(case, Status.FAILED, "no first token to cancel after")
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
        return self._row(case, Status.DROPPED, f"engine kept the request: {rec['status']}")

    async def _idle_by_load(self, case: Case, note: str) -> Row:
        for _ in range(100):
            load = await self.adapter.load()
            if load.running is None:
                return self._row(case, Status.NOT_APPLICABLE, "engine reports no load")
            if load.running == 0:
                status = self.carried(case)
                return self._row(case, status, note or "engine idle after cancel")
            await asyncio.sleep(0.05)
        return self._row(case, Status.DROPPED, "engine still running after cancel")


def _readable(message: str, pattern: str | None) -> bool:
    """The engine's error passed on as text (never a bytes literal such as
    ``b'{"detail": ...}'``), saying what the case expects."""
    if message.startswith(("b'", 'b"')):
        return False
    return pattern is None or re.search(pattern, message) is not None

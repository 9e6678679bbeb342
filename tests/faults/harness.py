"""Steady load against a fleet while a fault is injected, and an outcome checker
that reconciles what every client saw with the request ledger.

Categories per request (what a client experienced):
- rejected: refused before acceptance (no request id: 429/503 at the door);
- completed: the whole stream, ``[DONE]``, and text equal to the engine's own
  answer for the same body (so no token lost or repeated);
- failed: accepted, then ended with a visible error (an error event/status, or a
  broken connection the client could not resume);
- hung: no terminal event before the client's own patience ran out.

The checker adds, from the ledger: lost = accepted but hung, or with no ledger
record; duplicated = more than one admitted record for one request id, or a
completed text that differs from the reference.

Each scenario also says which requests its fault may fail (the ones it puts at
risk: :meth:`Report.assert_failures`), with which codes, and which refusals it
may cause (:meth:`Report.assert_rejections`): the suite passes only when every
visible failure is one the scenario's mechanism predicts. Times are wall-clock
``time.time()`` floats, as the ledger and the simulator keep them, so a
client's view, a fault's moment and the engine's records compare directly.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import nats.errors

from jetserve.commands.admin_client import AdminError
from jetserve.fleet import Fleet, Proc

# Past the outbox's grace and scan twice over, on a loaded box.
RECORDS_WITHIN_S = 60.0
PROMPTS = [f"fault scenario prompt number {i} about queues" for i in range(16)]
MAX_TOKENS = 24


def body(i: int) -> dict[str, object]:
    return {
        "model": "sim-8b",
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": PROMPTS[i]}],
    }


@dataclass
class Outcome:
    prompt: int
    kind: str  # rejected | completed | failed | hung
    request_id: str | None = None
    status: int = 0
    text: str = ""
    error: str | None = None
    resumed: bool = False
    last_id: int = 0  # the last SSE event id received in full (to resume after)
    sent_at: float = 0.0  # time.time(): the request went out
    first_at: float | None = None  # the first content token arrived
    ended_at: float = 0.0  # the client saw its end (or gave up)

    def open_during(self, window: Window) -> bool:
        """Sent before the window closed and not ended before it opened."""
        return self.sent_at < window.end and self.ended_at > window.start


@dataclass(frozen=True)
class Window:
    """A span of wall-clock time (a fault's, or an outage's)."""

    start: float
    end: float
    label: str = ""


@dataclass
class Report:
    outcomes: list[Outcome]
    accepted: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    hung: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    wrong_text: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)  # failures and refusals together
    failures: Counter[str] = field(default_factory=Counter)  # visibly failed, by code
    rejections: Counter[str] = field(default_factory=Counter)  # refused at the door, by code
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # admitted, by request id
    bound: int | None = None  # visible failures the scenario's mechanism allows
    bound_note: str = ""

    def row(self, name: str) -> str:
        bound = "" if self.bound is None else f" (bound {self.bound}: {self.bound_note})"
        return (
            f"{name}: accepted {self.accepted}, completed {self.completed}, visibly failed "
            f"{self.failed}{bound}, rejected {self.rejected}, lost {len(self.lost)}, duplicated "
            f"{len(self.duplicated) + len(self.wrong_text)}, hung {self.hung}; "
            f"failures {dict(self.failures)}; rejections {dict(self.rejections)}"
        )

    def assert_nothing_lost(self) -> None:
        assert self.hung == 0, self.row("hung clients")
        assert not self.lost, self.lost[:5]
        assert not self.duplicated, self.duplicated[:5]
        assert not self.wrong_text, self.wrong_text[:5]

    def accepted_outcomes(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind != "rejected"]

    def failed_outcomes(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == "failed"]

    def assert_failures(self, at_risk: Collection[str], codes: Collection[str], note: str) -> None:
        """Only requests the fault put at risk (``at_risk``: request ids) may fail,
        and only with ``codes``: then visibly failed <= |at risk| and completed >=
        accepted - |at risk|. ``note`` says what the bound counts (for the table)."""
        accepted = {o.request_id for o in self.accepted_outcomes() if o.request_id}
        self.bound, self.bound_note = len(accepted & set(at_risk)), note
        bad_code = [(o.request_id, o.error) for o in self.failed_outcomes() if o.error not in codes]
        assert not bad_code, f"failure codes outside {sorted(codes)}: {bad_code[:5]}; " + self.row(
            "unpredicted failure codes"
        )
        unpredicted = [o.request_id for o in self.failed_outcomes() if o.request_id not in at_risk]
        assert not unpredicted, f"failed but not at risk ({note}): {unpredicted[:5]}; " + self.row(
            "unpredicted failures"
        )
        assert self.failed <= self.bound, self.row("over the bound")
        assert self.completed >= self.accepted - self.bound, self.row("too few completed")

    def assert_no_failures(self, note: str = "nothing in flight is at risk") -> None:
        self.assert_failures((), (), note)

    def assert_rejections(
        self, codes: Collection[str], allowed: Callable[[Outcome], bool] | None = None
    ) -> None:
        """Refusals only with ``codes``, and only of requests ``allowed`` says the
        fault could refuse (by default: none beyond the codes)."""
        refused = [o for o in self.outcomes if o.kind == "rejected"]
        bad = [(o.error, round(o.sent_at, 2)) for o in refused if o.error not in codes]
        assert not bad, f"refusals outside {sorted(codes)}: {bad[:5]}; " + self.row("refusals")
        if allowed is not None:
            stray = [(o.error, round(o.sent_at, 2)) for o in refused if not allowed(o)]
            assert not stray, f"refused outside the fault: {stray[:5]}; " + self.row("refusals")

    def assert_served_after(self, t: float, what: str) -> None:
        """Every request sent at or after ``t`` (the fault is over) completed,
        and at least one was sent: the fleet recovered by itself."""
        after = [o for o in self.outcomes if o.sent_at >= t]
        assert after, f"no request sent after {what}"
        bad = [(o.kind, o.error) for o in after if o.kind != "completed"]
        assert not bad, f"after {what}: {len(bad)} of {len(after)} not completed: {bad[:5]}"


class Load:
    """Virtual users, each sending streaming requests one after another."""

    def __init__(
        self,
        fleet: Fleet,
        users: int = 16,
        timeout_s: float = 8.0,
        resume: bool = False,
        headers: dict[str, str] | None = None,
        seed: int = 7,
    ) -> None:
        self.fleet = fleet
        self.users = users
        self.timeout_s = timeout_s
        self.resume = resume
        self.headers = {"Authorization": f"Bearer {fleet.api_key}", **(headers or {})}
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tail_from: float | None = None
        self._tail_left = 0
        self._tail_done = asyncio.Event()

    async def run(
        self, duration_s: float, fault_over: asyncio.Event | None = None, tail: int = 3
    ) -> list[Outcome]:
        """Load for ``duration_s``; with ``fault_over``, also until ``tail``
        requests sent after it is set have ended (a fault that outlasts the load
        still gets requests sent after it, to show the fleet recovered). The
        tail is counted, not timed: on a loaded box every user may still be
        waiting out a request the fault stalled."""
        clients = [httpx.AsyncClient(timeout=self.timeout_s + 5) for _ in range(self.users)]
        try:
            users = [asyncio.create_task(self._user(c, u)) for u, c in enumerate(clients)]
            await asyncio.sleep(duration_s)
            if fault_over is not None:
                await fault_over.wait()
                self._tail_from, self._tail_left = time.time(), tail
                if tail > 0:
                    await self._tail_done.wait()
            self._stop.set()
            await asyncio.gather(*users)
        finally:
            for c in clients:
                await c.aclose()
        return self.outcomes

    async def _user(self, client: httpx.AsyncClient, user: int) -> None:
        while not self._stop.is_set():
            prompt = self.rng.randrange(len(PROMPTS))
            out = Outcome(prompt, "failed", sent_at=time.time())
            try:
                await asyncio.wait_for(
                    self._one(client, out), self.timeout_s + 10
                )  # the client's patience: past the request's own deadline
            except TimeoutError:
                out.kind = "hung"
            out.ended_at = time.time()
            self.outcomes.append(out)
            if self._tail_from is not None and out.sent_at >= self._tail_from:
                self._tail_left -= 1
                if self._tail_left <= 0:
                    self._tail_done.set()

    def _url(self, index: int) -> str:
        urls = [
            u
            for u, gw in zip(self.fleet.base_urls, self.fleet.gateways, strict=True)
            if gw.proc.poll() is None
        ] or self.fleet.base_urls
        return urls[index % len(urls)]

    async def _one(self, client: httpx.AsyncClient, out: Outcome) -> None:
        prompt = out.prompt
        headers = {**self.headers, "X-Jetserve-Timeout": str(self.timeout_s)}
        try:
            async with client.stream(
                "POST",
                f"{self._url(prompt)}/v1/chat/completions",
                json=body(prompt),
                headers=headers,
            ) as r:
                out.status = r.status_code
                out.request_id = r.headers.get("x-request-id")
                if r.status_code != 200:
                    error = msgspec.json.decode(await r.aread()).get("error", {})
                    out.error = str(error.get("code"))
                    out.kind = "rejected" if out.request_id is None else "failed"
                    return
                await self._consume(r, out)
        except (httpx.TransportError, httpx.StreamError) as exc:
            if out.request_id is None:
                out.kind, out.error = "rejected", type(exc).__name__
                return
            if not self.resume:
                out.error = f"connection broke: {type(exc).__name__}"
                return
        if out.kind != "completed" and out.error is None and self.resume and out.request_id:
            out.resumed = True
            try:
                async with client.stream(
                    "GET",
                    f"{self._url(prompt + 1)}/v1/requests/{out.request_id}/stream",
                    headers={**self.headers, "Last-Event-ID": str(out.last_id)},
                ) as r:
                    if r.status_code == 200:
                        await self._consume(r, out)
                    else:
                        out.error = f"resume refused: {r.status_code}"
            except (httpx.TransportError, httpx.StreamError) as exc:
                out.error = f"resume broke: {type(exc).__name__}"

    async def _consume(self, r: httpx.Response, out: Outcome) -> None:
        # As an EventSource does: an event's id counts once its data arrived (a
        # connection can break between the two lines). Kept on ``out``, so it
        # survives the exception a broken connection raises here.
        pending_id = 0
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                pending_id = int(line[4:])
            elif line == "data: [DONE]":
                out.kind = "completed"
            elif line.startswith("data: "):
                chunk = msgspec.json.decode(line[6:])
                if "error" in chunk:
                    out.kind, out.error = "failed", str(chunk["error"].get("code"))
                    return
                text = "".join(ch["delta"].get("content") or "" for ch in chunk["choices"])
                if text and out.first_at is None:
                    out.first_at = time.time()
                out.text += text
                out.last_id = pending_id


async def references(fleet: Fleet) -> list[str]:
    async with httpx.AsyncClient(timeout=30) as c:
        out = []
        for i in range(len(PROMPTS)):
            r = await c.post(
                f"{fleet.sim_url}/v1/chat/completions",
                json={**body(i), "stream": False},
                headers={"X-Sim-Fault": "none"},
            )
            out.append(str(r.json()["choices"][0]["message"]["content"]))
        return out


async def check(fleet: Fleet, outcomes: list[Outcome], refs: list[str]) -> Report:
    # Records are written at each request's end; one the stores could not take
    # then (a NATS outage, a leader election) waits in the outbox and is applied
    # by a scan (--outbox-grace 10 s, --outbox-scan 5 s). Wait (bounded) until
    # every accepted request that ended has its record, then judge.
    wanted = {o.request_id for o in outcomes if o.request_id and o.kind != "rejected"}
    rows: list[dict[str, Any]] = []
    end = time.monotonic() + RECORDS_WITHIN_S
    while time.monotonic() < end:
        rows = await ledger_rows(fleet) or rows
        if wanted <= {str(r["request_id"]) for r in rows}:
            break
        await asyncio.sleep(0.5)
    missing = wanted - {str(r["request_id"]) for r in rows}
    if missing:
        gone = sorted(missing)[:3]
        for log in sorted(fleet.workdir.glob("gateway*.log")):
            lines = log.read_text(errors="replace").splitlines()
            hits = [ln for ln in lines if any(g in ln for g in gone) or "outbox" in ln]
            print(f"\n{log.name} on {gone}: " + "\n".join(hits[-20:]))
        print(f"outbox now: {await outbox_size(fleet)}")
    admitted_rows = [r for r in rows if str(r["policy"]).startswith("admitted")]
    admitted = Counter(str(r["request_id"]) for r in admitted_rows)
    rep = Report(outcomes)
    for r in admitted_rows:
        rep.records.setdefault(str(r["request_id"]), r)
    for o in outcomes:
        if o.kind == "rejected":
            rep.rejected += 1
            rep.errors[o.error or "?"] += 1
            rep.rejections[o.error or "?"] += 1
            continue
        rep.accepted += 1
        if o.kind == "hung":
            rep.hung += 1
            rep.lost.append(o.request_id or "?")
            continue
        if o.kind == "completed":
            rep.completed += 1
            if o.text != refs[o.prompt]:
                rep.wrong_text.append(o.request_id or "?")
        else:
            rep.failed += 1
            rep.errors[o.error or "?"] += 1
            rep.failures[o.error or "?"] += 1
        if o.request_id and admitted[o.request_id] == 0:
            rep.lost.append(o.request_id)
    rep.duplicated = [rid for rid, n in admitted.items() if n > 1]
    return rep


async def outbox_size(fleet: Fleet) -> int | None:
    nc = await fleet.connect()
    try:
        info = await nc.jetstream().stream_info("JETSERVE_OUTBOX")
        return int(info.state.messages)
    except (nats.errors.Error, TimeoutError):
        return None
    finally:
        await nc.close()


async def ledger_rows(fleet: Fleet) -> list[dict[str, Any]] | None:
    """The tenant's ledger through the admin API; None when it could not be
    read this time (a 5xx or a broken connection: right after a NATS node died
    the admin API has answered 500 while the ledger stream elected a leader)."""
    try:
        with fleet.admin() as admin:
            text = await asyncio.to_thread(admin.ledger, fleet.spec.tenant)
    except (AdminError, httpx.TransportError) as exc:
        if isinstance(exc, AdminError) and exc.status < 500:
            raise
        return None
    return [msgspec.json.decode(x) for x in text.splitlines() if x]


# -- what the fleet's processes saw ------------------------------------------------------


async def engine_records(fleet: Fleet, request_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The simulator's record of each request (its latest engine attempt: a
    redelivered request's record replaces the earlier one): ``arrived_at``,
    ``first_token_at``, ``finished_at``, ``aborted_at``, ``fault``..."""
    sem = asyncio.Semaphore(8)
    out: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=fleet.sim_url, timeout=30) as c:

        async def one(rid: str) -> None:
            async with sem:
                r = await c.get(f"/sim/requests/{rid}")
            if r.status_code == 200:
                out[rid] = r.json()

        await asyncio.gather(*(one(rid) for rid in set(request_ids)))
    return out


async def engine_stats(fleet: Fleet) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as c:
        stats: dict[str, Any] = (await c.get(f"{fleet.sim_url}/sim/stats")).json()
        return stats


def worker_id(worker: Proc) -> str:
    """The id a worker puts on its frames and the ledger puts on its records."""
    return worker.args[worker.args.index("--worker-id") + 1]


def engine_started_before(o: Outcome, rec: dict[str, Any] | None, t: float) -> bool:
    """Whether the stream's first token may have left the engine before ``t``:
    by the engine's own record; conservatively yes when there is no record, or
    when the record is a later attempt's (it arrived after the client already
    had a token: an earlier attempt streamed, and JetStream redelivered it)."""
    if rec is None:
        return True
    if o.first_at is not None and float(rec["arrived_at"]) > o.first_at:
        return True
    first = rec.get("first_token_at")
    return first is not None and float(first) < t


def _established(ports: Collection[int]) -> dict[str, int]:
    """Established TCP connections to 127.0.0.1:``ports``: socket inode -> port."""
    out: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            remote, state, inode = cols[2], cols[3], cols[9]
            port = int(remote.rsplit(":", 1)[1], 16)
            if state == "01" and port in ports:
                out[inode] = port
    return out


def connections(procs: Iterable[Proc], ports: Collection[int]) -> Counter[str]:
    """Per live process (by name): its established TCP connections to any of
    ``ports`` on loopback (e.g. NATS nodes' client ports), from /proc."""
    sockets = _established(ports)
    out: Counter[str] = Counter()
    for p in procs:
        if p.proc.poll() is not None:
            continue
        fd_dir = f"/proc/{p.proc.pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in sockets:
                out[p.name] += 1
    return out


def tcp_peers(procs: Iterable[Proc], port: int) -> set[str]:
    """The processes (by name) connected to 127.0.0.1:``port``."""
    return set(connections(procs, {port}))


class Probe:
    """One request end to end (gateway, bus, a worker, the engine; no injected
    fault) tells whether the fleet serves; ``last`` keeps what it answered."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.last = "no answer yet"

    def __call__(self) -> bool:
        fleet = self.fleet
        headers = {
            "Authorization": f"Bearer {fleet.api_key}",
            "X-Sim-Fault": "none",
            "X-Jetserve-Timeout": "5",
        }
        live = [
            u
            for u, gw in zip(fleet.base_urls, fleet.gateways, strict=True)
            if gw.proc.poll() is None
        ]
        try:
            r = httpx.post(
                f"{live[0]}/v1/chat/completions",
                json={**body(0), "stream": False, "max_tokens": 2},
                headers=headers,
                timeout=10,
            )
        except httpx.TransportError as exc:
            self.last = type(exc).__name__
            return False
        self.last = f"{r.status_code} {r.text[:200]}"
        return r.status_code == 200


async def serving_again(fleet: Fleet, limit_s: float = 60.0) -> float:
    """Wait until the fleet serves a request end to end again; when it did.
    The limit is generous: a loaded 2-core box takes seconds where an idle one
    takes a few hundred milliseconds; past it the fleet did not recover."""
    probe = Probe(fleet)
    end = time.monotonic() + limit_s
    while not await asyncio.to_thread(probe):
        assert time.monotonic() < end, f"not serving again after {limit_s}s: {probe.last}"
        await asyncio.sleep(0.05)
    return time.time()


def dump(name: str, report: Report, **context: object) -> None:
    """With ``JETSERVE_FAULTS_DUMP=DIR``: every outcome, record and fault moment
    of a scenario as JSON in DIR (to study a failure afterwards)."""
    out = os.environ.get("JETSERVE_FAULTS_DUMP")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    data = {"outcomes": report.outcomes, "records": report.records, **context}
    with open(os.path.join(out, f"{name}.json"), "wb") as f:
        f.write(msgspec.json.encode(data))


def now() -> float:
    return time.monotonic()

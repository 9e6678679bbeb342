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
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import msgspec

from jetserve.fleet import Fleet

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
    errors: Counter[str] = field(default_factory=Counter)

    def row(self, name: str) -> str:
        return (
            f"{name}: accepted {self.accepted}, completed {self.completed}, visibly failed "
            f"{self.failed}, rejected {self.rejected}, lost {len(self.lost)}, duplicated "
            f"{len(self.duplicated) + len(self.wrong_text)}, hung {self.hung}; "
            f"errors {dict(self.errors)}"
        )

    def assert_nothing_lost(self) -> None:
        assert self.hung == 0, self.row("hung clients")
        assert not self.lost, self.lost[:5]
        assert not self.duplicated, self.duplicated[:5]
        assert not self.wrong_text, self.wrong_text[:5]


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

    async def run(self, duration_s: float) -> list[Outcome]:
        clients = [httpx.AsyncClient(timeout=self.timeout_s + 5) for _ in range(self.users)]
        try:
            users = [asyncio.create_task(self._user(c, u)) for u, c in enumerate(clients)]
            await asyncio.sleep(duration_s)
            self._stop.set()
            await asyncio.gather(*users)
        finally:
            for c in clients:
                await c.aclose()
        return self.outcomes

    async def _user(self, client: httpx.AsyncClient, user: int) -> None:
        while not self._stop.is_set():
            prompt = self.rng.randrange(len(PROMPTS))
            try:
                outcome = await asyncio.wait_for(
                    self._one(client, prompt), self.timeout_s + 10
                )  # the client's patience: past the request's own deadline
            except TimeoutError:
                outcome = Outcome(prompt, "hung")
            self.outcomes.append(outcome)

    def _url(self, index: int) -> str:
        urls = [
            u
            for u, gw in zip(self.fleet.base_urls, self.fleet.gateways, strict=True)
            if gw.proc.poll() is None
        ] or self.fleet.base_urls
        return urls[index % len(urls)]

    async def _one(self, client: httpx.AsyncClient, prompt: int) -> Outcome:
        out = Outcome(prompt, "failed")
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
                    return out
                await self._consume(r, out)
        except (httpx.TransportError, httpx.StreamError) as exc:
            if out.request_id is None:
                out.kind, out.error = "rejected", type(exc).__name__
                return out
            if not self.resume:
                out.error = f"connection broke: {type(exc).__name__}"
                return out
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
        return out

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
                out.text += "".join(ch["delta"].get("content") or "" for ch in chunk["choices"])
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
    # Records are written at each request's end, and a writer retries through a
    # NATS outage or leader election: wait (bounded) until every accepted request
    # that ended has its record, then judge.
    wanted = {o.request_id for o in outcomes if o.request_id and o.kind != "rejected"}
    rows: list[dict[str, object]] = []
    for _ in range(60):
        await asyncio.sleep(0.5)
        with fleet.admin() as admin:
            text = await asyncio.to_thread(admin.ledger, fleet.spec.tenant)
        rows = [msgspec.json.decode(x) for x in text.splitlines() if x]
        if wanted <= {str(r["request_id"]) for r in rows}:
            break
    admitted = Counter(
        str(r["request_id"]) for r in rows if str(r["policy"]).startswith("admitted")
    )
    rep = Report(outcomes)
    for o in outcomes:
        if o.kind == "rejected":
            rep.rejected += 1
            rep.errors[o.error or "?"] += 1
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
        if o.request_id and admitted[o.request_id] == 0:
            rep.lost.append(o.request_id)
    rep.duplicated = [rid for rid, n in admitted.items() if n > 1]
    return rep


def now() -> float:
    return time.monotonic()

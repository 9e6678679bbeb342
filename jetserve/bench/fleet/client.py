"""The client side of `jetserve bench fleet`: open-loop streaming requests against
a fleet's gateway, what each client saw, the per-run summary (latency always
beside the admission rate), and the ledger reconciliation."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import msgspec

from jetserve.bench.arrivals import gap
from jetserve.bench.metrics import percentile
from jetserve.bench.openloop import open_loop
from jetserve.fleet import Fleet

# (rng, i) -> (class, request body, extra headers): the i-th arrival's request.
MakeRequest = Callable[[random.Random, int], tuple[str, dict[str, Any], dict[str, str]]]
Fault = Callable[[], Coroutine[Any, Any, None]]  # run alongside the load (a kill, say)

WORDS = (
    "policy",
    "account",
    "refund",
    "shipping",
    "invoice",
    "warranty",
    "customer",
    "order",
    "delivery",
    "region",
    "support",
    "ticket",
    "escalation",
    "priority",
    "billing",
    "contract",
    "renewal",
    "discount",
    "loyalty",
)


@dataclass
class Shot:
    """What one client saw of one request."""

    cls: str
    sent: float
    status: int = 0
    request_id: str | None = None
    outcome: str = "error"  # ok | rejected | failed | lost
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Summary:
    name: str
    offered: int
    offered_rate: float
    admitted: int
    admission_rate: float  # admitted / offered: beside every latency figure
    completed: int
    goodput_rps: float  # completed within the deadline, per second of the run
    rejected: int
    failed: int
    lost: int
    errors: dict[str, int]
    ttft_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    prefix_hit_rate: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def pct_ms(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile in ms (a value some request saw), None when empty."""
    if not values:
        return None
    return round(percentile(values, q, method="nearest") * 1000, 1)


def summarize(name: str, shots: list[Shot], duration: float, **extra: Any) -> Summary:
    admitted = [s for s in shots if s.outcome != "rejected"]
    done = [s for s in shots if s.outcome == "ok"]
    ttfts = [s.ttft for s in done if s.ttft is not None]
    e2es = [s.e2e for s in done if s.e2e is not None]
    prompt = sum(s.prompt_tokens for s in done)
    return Summary(
        name=name,
        offered=len(shots),
        offered_rate=round(len(shots) / duration, 2),
        admitted=len(admitted),
        admission_rate=round(len(admitted) / max(len(shots), 1), 3),
        completed=len(done),
        goodput_rps=round(len(done) / duration, 2),
        rejected=len(shots) - len(admitted),
        failed=sum(1 for s in shots if s.outcome == "failed"),
        lost=sum(1 for s in shots if s.outcome == "lost"),
        errors=dict(Counter(s.error for s in shots if s.error)),
        ttft_ms={f"p{q}": pct_ms(ttfts, q) for q in (50, 90, 95, 99)},
        e2e_ms={f"p{q}": pct_ms(e2es, q) for q in (50, 90, 99)},
        prefix_hit_rate=round(sum(s.cached_tokens for s in done) / prompt, 3) if prompt else None,
        extra=extra,
    )


# -- the client --------------------------------------------------------------------


class Gateways(Protocol):
    """Where a driver sends: a :class:`Fleet`, or :class:`GatewayUrls` in a
    process of its own."""

    @property
    def base_urls(self) -> list[str]: ...

    @property
    def api_key(self) -> str | None: ...


@dataclass(frozen=True)
class GatewayUrls:
    base_urls: list[str]
    api_key: str | None


class Driver:
    """Open-loop Poisson arrivals; one streaming request per arrival."""

    def __init__(self, fleet: Gateways, seed: int, patience_s: float) -> None:
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.patience = patience_s
        self.clients = [
            httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=8))
            for _ in range(32)
        ]
        self._turn = 0

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()

    async def run(
        self, rate: float, duration: float, make: MakeRequest, during: Fault | None = None
    ) -> list[Shot]:
        """Poisson arrivals at ``rate`` for ``duration`` seconds, ``during`` (a
        fault) alongside; every shot once all have ended."""
        t0 = time.monotonic()

        def arrivals() -> Iterator[float]:
            at = gap(self.rng, rate, 1.0)
            while at < duration:
                yield at
                at += gap(self.rng, rate, 1.0)

        def start(i: int) -> Coroutine[Any, Any, Shot]:
            cls, body, headers = make(self.rng, i)
            return self.one(cls, body, headers, t0)

        async with asyncio.TaskGroup() as tg:
            if during is not None:
                tg.create_task(during())
            shots = await open_loop(arrivals(), start, t0=t0, clock=time.monotonic)
        return shots

    async def one(self, cls: str, body: dict[str, Any], headers: dict[str, str], t0: float) -> Shot:
        client = self.clients[self._turn % len(self.clients)]
        self._turn += 1
        shot = Shot(cls=cls, sent=time.monotonic() - t0)
        sent = time.monotonic()
        hdrs = {
            "Authorization": f"Bearer {self.fleet.api_key}",
            "X-Jetserve-Class": cls,
            **headers,
        }
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with asyncio.timeout(self.patience):
                await self._stream(client, payload, hdrs, shot, sent)
        except TimeoutError:
            # Past the request's own deadline plus a margin: nothing terminal came.
            shot.outcome, shot.error = ("lost", "hung") if shot.request_id else ("error", "hung")
        except httpx.HTTPError as exc:
            shot.outcome = "failed" if shot.request_id else "error"
            shot.error = type(exc).__name__
        return shot

    async def _stream(
        self,
        client: httpx.AsyncClient,
        payload: dict[str, Any],
        headers: dict[str, str],
        shot: Shot,
        sent: float,
    ) -> None:
        # Across the fleet's gateways in turn (one, mostly).
        bases = self.fleet.base_urls
        url = f"{bases[self._turn % len(bases)]}/v1/chat/completions"
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            shot.status = r.status_code
            shot.request_id = r.headers.get("x-request-id")
            if r.status_code != 200:
                err = msgspec.json.decode(await r.aread()).get("error", {})
                shot.error = str(err.get("code"))
                # No request id: refused at the door (shed, queue full, rate
                # limit), nothing accepted. With one: accepted, then failed.
                shot.outcome = "rejected" if shot.request_id is None else "failed"
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    shot.outcome = "ok"
                    shot.e2e = time.monotonic() - sent
                    return
                if not line.startswith("data: "):
                    continue
                chunk = msgspec.json.decode(line[6:])
                if "error" in chunk:
                    shot.outcome, shot.error = "failed", str(chunk["error"].get("code"))
                    return
                if shot.ttft is None and any(
                    (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()
                ):
                    shot.ttft = time.monotonic() - sent
                usage = chunk.get("usage")
                if usage:
                    shot.prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    shot.cached_tokens = details.get("cached_tokens", 0)
            shot.outcome, shot.error = "failed", "stream ended without [DONE]"


def system_prompt(group: int, words: int) -> str:
    rng = random.Random(group)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the assistant of team {group}. Follow these notes: {body}."


def chat(system: str | None, question: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"model": "sim-8b", "max_tokens": max_tokens, "messages": messages}


def gateway_metric(fleet: Fleet, name: str) -> dict[str, float]:
    """Samples of one gateway metric, by their label string, summed over the
    fleet's gateways."""
    out: dict[str, float] = {}
    for url in fleet.gateway_metrics_urls:
        text = httpx.get(url, timeout=5).text
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
            if m:
                key = m.group(1) or ""
                out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


async def ledger_check(fleet: Fleet, shots: list[Shot]) -> dict[str, int]:
    """Every accepted request has exactly one admitted ledger record."""
    want = {s.request_id for s in shots if s.request_id}
    rows: list[dict[str, Any]] = []
    for _ in range(60):
        with fleet.admin() as admin:
            text = await asyncio.to_thread(admin.ledger, fleet.spec.tenant)
        rows = [msgspec.json.decode(x) for x in text.splitlines() if x]
        if want <= {r["request_id"] for r in rows}:
            break
        await asyncio.sleep(0.5)
    counts = Counter(r["request_id"] for r in rows if str(r["policy"]).startswith("admitted"))
    return {
        "accepted": len(want),
        "with_record": sum(1 for rid in want if counts[rid] >= 1),
        "without_record": sum(1 for rid in want if counts[rid] == 0),
        "duplicated": sum(1 for rid in want if counts[rid] > 1),
    }

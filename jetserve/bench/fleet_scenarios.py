"""`jetserve bench fleet`: the fleet-routing scenarios, each on fresh real fleets
(NATS, Redis, gateway, workers, one simulator per replica), each compared with
its own baseline in the same run.

- ``affinity``: 4 replicas, h100-8b profile, many groups sharing long system
  prompts (the groups' prefixes overflow one replica's KV cache but fit the
  fleet's): prefix-cache hit rate and TTFT for affinity vs round-robin vs
  least-loaded routing.
- ``saturation``: offered load at 2x the measured capacity, interactive and
  batch mixed, with deadline-aware shedding on and off: goodput per class,
  explicit rejections (429 ``deadline_unmeetable``) and admission rate.
- ``failover``: a replica (worker and engine) SIGKILLed mid-run: every accepted
  request ends completed or visibly failed, reconciled against the ledger.
- ``hedging``: an engine profile with a heavy first-token tail (5% of requests
  stall 1.5 s): TTFT percentiles with and without hedging, and what it cost.

Every latency figure is published beside the admission rate it was measured at.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from jetserve.fleet import Fleet, FleetSpec

SCENARIOS = ("affinity", "saturation", "failover", "hedging")
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


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] * 1000, 1)


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
        ttft_ms={f"p{q}": _pct(ttfts, q / 100) for q in (50, 90, 95, 99)},
        e2e_ms={f"p{q}": _pct(e2es, q / 100) for q in (50, 90, 99)},
        prefix_hit_rate=round(sum(s.cached_tokens for s in done) / prompt, 3) if prompt else None,
        extra=extra,
    )


# -- the client --------------------------------------------------------------------


class Driver:
    """Open-loop Poisson arrivals; one streaming request per arrival."""

    def __init__(self, fleet: Fleet, seed: int, patience_s: float) -> None:
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
        self,
        rate: float,
        duration: float,
        make: Any,  # (rng, i) -> (cls, body, headers)
        during: Any = None,  # an optional coroutine run alongside (a fault)
    ) -> tuple[list[Shot], float]:
        t0 = time.monotonic()
        tasks: list[asyncio.Task[Shot]] = []
        side = asyncio.create_task(during()) if during is not None else None
        at, i = 0.0, 0
        while True:
            at += self.rng.expovariate(rate)
            if at >= duration:
                break
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            cls, body, headers = make(self.rng, i)
            tasks.append(asyncio.create_task(self.one(cls, body, headers, t0)))
            i += 1
        shots = list(await asyncio.gather(*tasks))
        if side is not None:
            await side
        return shots, duration

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
        url = f"{self.fleet.base_url}/v1/chat/completions"
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
    """Samples of one gateway metric, by their label string."""
    text = httpx.get(f"{fleet.base_url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
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


def _fleet(**kw: Any) -> Fleet:
    return Fleet(FleetSpec(**kw)).start()


async def _run(fleet: Fleet, seed: int, patience: float, *args: Any, **kw: Any) -> list[Shot]:
    driver = Driver(fleet, seed, patience)
    try:
        await asyncio.sleep(1.5)  # lane priorities settle after the last worker joined
        shots, _ = await driver.run(*args, **kw)
        return shots
    finally:
        await driver.aclose()


# -- the scenarios ---------------------------------------------------------------


async def affinity(opts: Options) -> dict[str, Any]:
    groups, words = opts.groups, opts.prefix_words
    prompts = [system_prompt(g, words) for g in range(groups)]

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        g = rng.randrange(groups)
        return "interactive", chat(prompts[g], f"Request {i}: what applies to case {g}?", 24), {}

    rows = []
    for mode in ("affinity", "round_robin", "least_loaded"):
        fleet = await asyncio.to_thread(
            _fleet,
            workers=4,
            engine_per_worker=True,
            profile="h100-8b",
            sim_args=["--num-gpu-blocks", str(opts.gpu_blocks)],
            gateway_args=["--routing", mode],
        )
        try:
            shots = await _run(fleet, opts.seed, 60.0, opts.rate, opts.duration, make)
        finally:
            await asyncio.to_thread(fleet.stop)
        rows.append(summarize(mode, shots, opts.duration))
    return {
        "scenario": "affinity",
        "setup": {
            "replicas": 4,
            "profile": "h100-8b",
            "gpu_blocks_per_replica": opts.gpu_blocks,
            "kv_tokens_per_replica": opts.gpu_blocks * 16,
            "groups": groups,
            "system_prompt_words": words,
            "rate_rps": opts.rate,
            "duration_s": opts.duration,
        },
        "rows": [asdict(r) for r in rows],
    }


async def saturation(opts: Options) -> dict[str, Any]:
    """Capacity first (the completion rate under overload, shedding off), then 2x it."""
    timeout = opts.deadline_s
    sim = ["--max-num-seqs", "4"]
    worker = ["--max-inflight", "4"]

    def make_cls(mix: float) -> Any:
        def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
            cls = "interactive" if rng.random() < mix else "batch"
            body = chat(None, f"Request {i}: summarise the ticket queue.", 48)
            return cls, body, {"X-Jetserve-Timeout": str(timeout)}

        return make

    fleet = await asyncio.to_thread(
        _fleet,
        workers=2,
        engine_per_worker=True,
        profile="h100-8b",
        sim_args=sim,
        worker_args=worker,
        gateway_args=["--no-shed"],
    )
    try:
        probe = await _run(fleet, opts.seed, timeout + 10, 40.0, 8.0, make_cls(1.0))
    finally:
        await asyncio.to_thread(fleet.stop)
    # Completions per second while the queue was never empty = capacity.
    ends = sorted(s.sent + (s.e2e or 0) for s in probe if s.outcome == "ok")
    capacity = len(ends) / max(ends[-1] - ends[0], 1e-3) if len(ends) > 1 else 1.0
    rate = 2 * capacity
    rows = []
    for mix, mix_name in ((1.0, "interactive only"), (0.5, "half batch")):
        for shed in (True, False):
            fleet = await asyncio.to_thread(
                _fleet,
                workers=2,
                engine_per_worker=True,
                profile="h100-8b",
                sim_args=sim,
                worker_args=worker,
                gateway_args=[] if shed else ["--no-shed"],
            )
            try:
                shots = await _run(
                    fleet, opts.seed, timeout + 10, rate, opts.duration, make_cls(mix)
                )
            finally:
                await asyncio.to_thread(fleet.stop)
            name = f"{mix_name}, {'shedding' if shed else 'no shedding'}"
            rows.append(summarize(name, shots, opts.duration))
            if mix < 1.0:
                for cls in ("interactive", "batch"):
                    part = [s for s in shots if s.cls == cls]
                    rows.append(summarize(f"  {cls}", part, opts.duration))
    return {
        "scenario": "saturation",
        "setup": {
            "replicas": 2,
            "max_num_seqs": 4,
            "deadline_s": timeout,
            "capacity_rps": round(capacity, 2),
            "offered_rps": round(rate, 2),
            "mixes": "interactive only; 50% interactive, 50% batch",
            "duration_s": opts.duration,
        },
        "rows": [asdict(r) for r in rows],
    }


async def failover(opts: Options) -> dict[str, Any]:
    prompts = [system_prompt(g, 400) for g in range(16)]

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        g = rng.randrange(len(prompts))
        body = chat(prompts[g], f"Request {i} for team {g}.", 48)
        return "interactive", body, {"X-Jetserve-Timeout": "20"}

    fleet = await asyncio.to_thread(_fleet, workers=4, engine_per_worker=True, profile="h100-8b")
    killed: dict[str, Any] = {}

    async def kill_one() -> None:
        await asyncio.sleep(opts.duration / 2)
        killed["at_s"] = round(opts.duration / 2, 1)
        killed["worker"] = fleet.workers[1].name
        fleet.workers[1].kill()
        sim = fleet.worker_sims[1]
        if sim is not None:
            sim.kill()

    try:
        shots = await _run(fleet, opts.seed, 40.0, opts.rate, opts.duration, make, during=kill_one)
        ledger = await ledger_check(fleet, shots)
    finally:
        await asyncio.to_thread(fleet.stop)
    row = summarize("replica killed mid-run", shots, opts.duration)
    return {
        "scenario": "failover",
        "setup": {"replicas": 4, "rate_rps": opts.rate, "duration_s": opts.duration, **killed},
        "ledger": ledger,
        "rows": [asdict(row)],
    }


async def hedging(opts: Options) -> dict[str, Any]:
    tail = ["--fault-rate", "stall:1500=0.03"]

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        return "interactive", chat(None, f"Request {i}: a quick answer please.", 16), {}

    rows = []
    extra: dict[str, Any] = {}
    for hedge in (False, True):
        fleet = await asyncio.to_thread(
            _fleet,
            workers=4,
            engine_per_worker=True,
            profile="h100-8b",
            sim_args=tail,
            gateway_args=["--hedge", "p95", "--hedge-max-extra", "0.1"] if hedge else [],
        )
        try:
            shots = await _run(fleet, opts.seed, 30.0, opts.rate, opts.duration, make)
            hedges = await asyncio.to_thread(gateway_metric, fleet, "jetserve_gateway_hedges_total")
        finally:
            await asyncio.to_thread(fleet.stop)
        by_outcome: Counter[str] = Counter()
        for labels, value in hedges.items():
            m = re.search(r'outcome="(\w+)"', labels)
            if m:
                by_outcome[m.group(1)] += int(value)
        sent = by_outcome.get("sent", 0)
        name = "hedging (p95)" if hedge else "no hedging"
        extra = {
            "hedges": dict(by_outcome),
            "extra_attempts": sent,
            "extra_attempt_ratio": round(sent / max(len(shots), 1), 3),
        }
        rows.append(summarize(name, shots, opts.duration, **extra))
    return {
        "scenario": "hedging",
        "setup": {
            "replicas": 4,
            "profile": "h100-8b",
            "tail": "3% of requests: first token delayed 1.5 s (simulator stall:1500)",
            "hedge_cap": "10% of requests",
            "rate_rps": opts.rate,
            "duration_s": opts.duration,
        },
        "rows": [asdict(r) for r in rows],
    }


@dataclass(frozen=True)
class Options:
    scenarios: tuple[str, ...] = SCENARIOS
    out: Path = Path("bench/results/fleet")
    seed: int = 1
    rate: float = 12.0
    duration: float = 30.0
    groups: int = 32
    prefix_words: int = 600
    gpu_blocks: int = 1024
    deadline_s: float = 4.0


RUNNERS = {"affinity": affinity, "saturation": saturation, "failover": failover, "hedging": hedging}


async def run_all(opts: Options) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in opts.scenarios:
        print(f"== {name}", flush=True)
        results[name] = await RUNNERS[name](opts)
        (opts.out / f"{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
        print(render(results[name]), flush=True)
    return results


def render(result: dict[str, Any]) -> str:
    """One markdown table per scenario: latency beside the admission rate."""
    head = (
        "| run | offered | admitted | admission rate | completed | goodput/s | rejected | "
        "failed | lost | TTFT p50 | TTFT p90 | TTFT p99 | prefix hit rate |"
    )
    lines = [f"### {result['scenario']}", "", f"setup: `{json.dumps(result['setup'])}`", ""]
    lines += [head, "|" + "---|" * 13]
    for r in result["rows"]:
        t = r["ttft_ms"]
        hit = "" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.1%}"
        lines.append(
            f"| {r['name']} | {r['offered']} | {r['admitted']} | {r['admission_rate']:.1%} | "
            f"{r['completed']} | {r['goodput_rps']} | {r['rejected']} | {r['failed']} | "
            f"{r['lost']} | {t['p50']} | {t['p90']} | {t['p99']} | {hit} |"
        )
    for r in result["rows"]:
        if r["extra"]:
            lines.append(f"\n{r['name']}: `{json.dumps(r['extra'])}`")
        if r["errors"]:
            lines.append(f"\n{r['name']} errors: `{json.dumps(r['errors'])}`")
    if "ledger" in result:
        lines.append(f"\nledger reconciliation: `{json.dumps(result['ledger'])}`")
    return "\n".join(lines)

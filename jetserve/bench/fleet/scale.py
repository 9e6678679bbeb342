"""The ``scale`` scenario (issue 16): a 64-replica fleet on one machine, with a
shared-prefix trace.

- 64 engines (``jetserve sim --replicas``, 32 to a process) driven by worker
  processes of 8 engines each (``jetserve worker --engine ... --engine``), one
  gateway. The prefixes of the trace overflow one replica's KV cache many times
  over but fit the fleet's.
- **Affinity against round-robin**: one fresh fleet each, the same trace: the
  prefix-cache hit share, TTFT, and how evenly the replicas serve (each
  replica's request count from its own ``/sim/stats``).
- **The oracle**: the same trace on one engine whose cache never evicts (and
  ``max_num_seqs`` the fleet's): the best hit share any routing could reach.
- **Scale mid-run** (affinity fleet): replicas of one engine each join and
  leave while the load runs: 64 -> 65 (a replica starts), 65 -> 64 (it is
  SIGKILLed), 64 -> 63 (another is). For each change: the share of lanes whose
  owner moved (rendezvous assignment over the members before and after,
  streams/rendezvous.py) and how long until the hit share of what is sent is
  back to its level before the change.

The ``kvindex`` scenario is the same on a smaller fleet (16 replicas by
default: 64 with two arms and changes is more than a busy 2-core machine
drives), comparing hash lanes (``affinity``) with KV-event-aware routing
(``kv_index``: engines publish vLLM's KV events, workers feed the index, the
gateway routes by it, docs/routing.md), both through the same membership
changes: hash lanes move at a change, the index keeps each cached prefix on
the replica that holds it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from jetserve.bench.fleet.client import (
    Driver,
    MakeRequest,
    Shot,
    Summary,
    chat,
    summarize,
    system_prompt,
)
from jetserve.fleet import Fleet, FleetSpec, Proc
from streams.definitions import DEFAULT_TOPOLOGY
from streams.membership import MEMBERS_BUCKET
from streams.rendezvous import assign
from streams.subjects import RequestClass

REPLICAS = 64
PER_SIM = 32
PER_WORKER = 8
WINDOW_S = 2.0  # the hit-share time series, per window of send times
PATIENCE_S = 60.0


@dataclass(frozen=True)
class Lanes:
    """The interactive class's lanes and the gateway's ``--lane-load-factor``."""

    count: int = DEFAULT_TOPOLOGY.lanes_of(RequestClass.INTERACTIVE)  # the product's 256
    load_factor: float = DEFAULT_TOPOLOGY.lane_load_factor

    def moved(self, before: list[str], after: list[str]) -> float | None:
        """The share of lanes whose owner moved; None when a look found no
        members (on a loaded machine every heartbeat can miss the bucket's 4 s TTL)."""
        if not before or not after:
            return None
        old, new = (assign(m, self.count, load_factor=self.load_factor) for m in (before, after))
        return round(old.moved(new), 4)


def _spec(replicas: int, mode: str, blocks: int, lanes: Lanes) -> FleetSpec:
    kv = mode == "kv_index"  # hash lanes with the KV index on top
    # events_only: hash lanes, the engines publishing and the workers following
    # their KV events (the index's cost without its routing).
    events = kv or mode == "events_only"
    if mode == "events_only":
        mode = "affinity"
    return FleetSpec(
        workers=0,
        profile="h100-8b",
        sim_replicas=replicas,
        replicas_per_sim=PER_SIM,
        engines_per_worker=PER_WORKER,
        sim_args=["--num-gpu-blocks", str(blocks)],
        gateway_args=[
            *(["--routing", "affinity", "--kv-index"] if kv else ["--routing", mode]),
            *("--lane-load-factor", str(lanes.load_factor)),
        ],
        kv_events=events,
        # The same worker ids in every arm: the same lanes move at each change.
        worker_id_suffix="bench",
        lanes=lanes.count,
    )


def _balance(counts: list[int]) -> dict[str, Any]:
    mean = sum(counts) / max(len(counts), 1)
    return {
        "replicas": len(counts),
        "serving": sum(1 for c in counts if c),
        "mean": round(mean, 2),
        "busiest": max(counts, default=0),
        "busiest_over_mean": round(max(counts, default=0) / mean, 2) if mean else None,
        "idlest": min(counts, default=0),
    }


def _hit_series(shots: list[Shot]) -> list[tuple[float, float]]:
    """(window start, hit share of the requests sent in it)."""
    by: dict[int, list[Shot]] = {}
    for s in shots:
        if s.outcome == "ok":
            by.setdefault(int(s.sent // WINDOW_S), []).append(s)
    out = []
    for w in sorted(by):
        prompt = sum(s.prompt_tokens for s in by[w])
        if prompt:
            out.append((w * WINDOW_S, sum(s.cached_tokens for s in by[w]) / prompt))
    return out


def _recovery(series: list[tuple[float, float]], at: float) -> dict[str, Any]:
    """The hit share before ``at`` (the windows after warm-up) and the seconds
    after it until a window is back to 95 % of that level."""
    before = [h for t, h in series if at - 10.0 <= t < at - WINDOW_S]
    level = statistics.median(before) if before else None
    after = [(t, h) for t, h in series if t >= at]
    back = next((t for t, h in after if level is not None and h >= 0.95 * level), None)
    low = min((h for t, h in after if t < at + 10.0), default=None)
    return {
        "before": round(level, 3) if level is not None else None,
        "lowest_within_10s": round(low, 3) if low is not None else None,
        "recovered_after_s": round(back - at, 1) if back is not None else None,
    }


async def _members(fleet: Fleet) -> list[str]:
    """The live members, as the bucket holds them. A fleet always has some: a
    look that finds none (the watch's end marker can come before its first
    entry on a loaded machine) is taken again."""
    for _ in range(20):
        members = await _look(fleet)
        if members:
            return members
        await asyncio.sleep(0.25)
    return []


async def _look(fleet: Fleet) -> list[str]:
    """One watch of the members bucket to its current end."""
    nc = await fleet.connect()
    try:
        kv = await nc.jetstream().key_value(MEMBERS_BUCKET)
        watcher = await kv.watchall(meta_only=True)
        keys = set()
        async with asyncio.timeout(30):
            async for entry in watcher:
                if entry is None:
                    break
                if entry.operation is None:  # a put: deletes and purges carry theirs
                    keys.add(entry.key)
        await watcher.stop()  # type: ignore[no-untyped-call]
        return sorted(keys)
    finally:
        await nc.close()


async def _until_members(fleet: Fleet, want: int) -> list[str]:
    """The members once there are ``want`` (a SIGKILLed one expires in 4 s)."""
    end = time.monotonic() + 60
    while True:
        members = await _members(fleet)
        if len(members) == want or time.monotonic() > end:
            return members
        await asyncio.sleep(0.25)


async def _single(fleet: Fleet, blocks: int) -> Proc:
    """One more replica of one engine: its own simulator and worker process."""
    url = await asyncio.to_thread(fleet.start_engine, "--num-gpu-blocks", str(blocks))
    return await asyncio.to_thread(fleet.start_worker, wait=False, engine=url)


class Changes:
    """64 -> 65 -> 64 -> 63 while the load runs, a change every quarter of it:
    a single-engine replica starts, then it is SIGKILLed, then the one the
    fleet started with is."""

    def __init__(self, fleet: Fleet, first: Proc, blocks: int, lanes: Lanes) -> None:
        self.fleet, self.singles, self.blocks, self.lanes = fleet, [first], blocks, lanes
        self.log: list[dict[str, Any]] = []

    async def run(self, t0: float, duration: float) -> None:
        for n, grow in ((1, True), (2, False), (3, False)):
            await asyncio.sleep(max(0.0, t0 + n * duration / 4 - time.monotonic()))
            before = await _members(self.fleet)
            if grow:
                self.singles.append(await _single(self.fleet, self.blocks))
            else:
                self.singles.pop().signal(9)  # no goodbye: its entry expires
            at = time.monotonic() - t0
            after = await _until_members(self.fleet, len(before) + (1 if grow else -1))
            self.log.append(
                {
                    "change": f"{len(before)} -> {len(after)}",
                    "at_s": round(at, 1),
                    "lanes_moved": self.lanes.moved(before, after),
                }
            )


def _measured(shots: list[Shot], warmup: float) -> list[Shot]:
    """The shots sent after the warm-up, their send times from its end."""
    out = [s for s in shots if s.sent >= warmup]
    for s in out:
        s.sent -= warmup
    return out


async def _served_all(fleet: Fleet) -> dict[str, int]:
    urls = [*fleet.replica_urls, *(f"http://127.0.0.1:{p}" for p in fleet.extra_ports())]
    async with httpx.AsyncClient(timeout=10) as c:
        out = {}
        for u in urls:
            try:
                out[u] = int((await c.get(f"{u}/sim/stats")).json()["requests"])
            except httpx.HTTPError:
                out[u] = 0  # SIGKILLed meanwhile: its worker's, anyway
        return out


async def _kv_routes(fleet: Fleet) -> dict[str, float]:
    """The gateway's KV routing decisions by source (``--kv-index`` only)."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(fleet.gateway_metrics_urls[0])).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("jetserve_gateway_kv_routes_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


async def _mode(
    mode: str,
    seed: int,
    rate: float,
    duration: float,
    make: MakeRequest,
    blocks: int,
    replicas: int = REPLICAS,
    warmup: float = 0.0,
    lanes: Lanes = Lanes(),
) -> tuple[Summary, dict[str, Any], list[Shot], list[dict[str, Any]], dict[str, float]]:
    spec = _spec(replicas - 1, mode, blocks, lanes)
    fleet = await asyncio.to_thread(lambda: Fleet(spec).start())
    driver = Driver(fleet, seed, PATIENCE_S)
    kv_routes: dict[str, float] = {}
    try:
        changes = Changes(fleet, await _single(fleet, blocks), blocks, lanes)
        await _until_members(fleet, replicas)
        await asyncio.sleep(2.0)  # lane ranks settle after the last replica joined
        before: dict[str, int] = {}
        start = time.monotonic()
        changing = mode in ("affinity", "kv_index", "events_only")

        async def during() -> None:
            # The same load runs through the warm-up; what is measured (served
            # counts, shots, the changes' times) starts at its end.
            await asyncio.sleep(max(0.0, start + warmup - time.monotonic()))
            before.update(await _served_all(fleet))
            if changing:
                await changes.run(start + warmup, duration)

        shots = await driver.run(rate, warmup + duration, make, during)
        after = await _served_all(fleet)
        if mode == "kv_index":
            kv_routes = await _kv_routes(fleet)
    finally:
        await driver.aclose()
        await asyncio.to_thread(fleet.stop)
    counts = [after[u] - before.get(u, 0) for u in after]
    balance = _balance(counts)
    # The replicas there all the measured run (not the one that joined and
    # left, nor the one killed three quarters in): their shares compare alike.
    steady = set(fleet.replica_urls)
    balance["steady"] = _balance([after[u] - before.get(u, 0) for u in after if u in steady])
    shots = _measured(shots, warmup)
    return summarize(mode, shots, duration), balance, shots, changes.log, kv_routes


async def scale(
    seed: int,
    rate: float,
    duration: float,
    groups: int,
    words: int,
    blocks: int,
    replicas: int = REPLICAS,
    modes: tuple[str, ...] = ("round_robin", "affinity"),
    name: str = "scale",
    warmup: float = 0.0,
    lanes: Lanes = Lanes(),
) -> dict[str, Any]:
    prompts = [system_prompt(g, words) for g in range(groups)]
    # Some prefixes are far more popular than others (Zipf-like, s = 0.6).
    weights = [1 / (g + 1) ** 0.6 for g in range(groups)]

    def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        g = rng.choices(range(groups), weights)[0]
        return "interactive", chat(prompts[g], f"Request {i}: what applies to case {g}?", 16), {}

    rows, balance, series_out = [], {}, {}
    by_mode: dict[str, list[dict[str, Any]]] = {}
    kv_routes: dict[str, float] = {}
    for mode in modes:
        row, balance[mode], shots, log, routes = await _mode(
            mode, seed, rate, duration, make, blocks, replicas, warmup, lanes
        )
        rows.append(row)
        kv_routes |= routes
        series = _hit_series(shots)
        series_out[mode] = [[t, round(h, 3)] for t, h in series]
        if log and mode in ("affinity", "kv_index", "events_only"):
            by_mode[mode] = [c | _recovery(series, c["at_s"]) for c in log]
    rows.append(await _oracle(seed, rate, duration, make, warmup))
    hit = {r.name: r.prefix_hit_rate for r in rows}
    oracle = hit.get("oracle")
    extra: dict[str, Any] = {}
    if len(by_mode) > 1:
        extra["changes_by_mode"] = by_mode
    if kv_routes:
        extra["kv_routes"] = kv_routes  # the kv_index arm's gateway: index vs hash
    return {
        "scenario": name,
        **extra,
        "setup": {
            "replicas": replicas,
            "replicas_per_sim_process": PER_SIM,
            "engines_per_worker_process": PER_WORKER,
            "profile": "h100-8b",
            "gpu_blocks_per_replica": blocks,
            "groups": groups,
            "system_prompt_words": words,
            "group_popularity": "1/(g+1)^0.6",
            "rate_rps": rate,
            "duration_s": duration,
            "warmup_s": warmup,  # the same load before the measured duration
            "lanes": lanes.count,
            "lane_load_factor": lanes.load_factor,
        },
        "balance": balance,
        "hit_share_of_oracle": {
            k: round(v / oracle, 3) if v is not None and oracle else None for k, v in hit.items()
        },
        "changes": next(iter(by_mode.values()), []),
        "hit_series": series_out,
        "rows": [asdict(r) for r in rows],
    }


async def _oracle(
    seed: int, rate: float, duration: float, make: MakeRequest, warmup: float = 0.0
) -> Summary:
    """The same trace on one engine that never evicts: the best hit share."""
    spec = FleetSpec(
        workers=1,
        profile="h100-8b",
        sim_args=["--num-gpu-blocks", "1000000", "--max-num-seqs", "256"],
        worker_args=["--max-inflight", "256"],
        gateway_args=["--routing", "least_loaded"],
    )
    fleet = await asyncio.to_thread(lambda: Fleet(spec).start())
    driver = Driver(fleet, seed, PATIENCE_S)
    try:
        shots = await driver.run(rate, warmup + duration, make)
    finally:
        await driver.aclose()
        await asyncio.to_thread(fleet.stop)
    return summarize("oracle", _measured(shots, warmup), duration)

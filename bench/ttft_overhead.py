"""Gateway overhead: TTFT and e2e through jetserve vs the simulator directly.

Starts a real fleet (nats-server, redis-server, simulator with a latency
profile, gateway, workers), then sends the same kind of streaming requests to
both targets, interleaved, with unique prompts (no prefix-cache advantage for
either). Writes JSON to bench/results/. Usage:

    .venv/bin/python bench/ttft_overhead.py [--requests 200] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import uuid
from pathlib import Path

import httpx

from jetserve.fleet import Fleet, FleetSpec


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one(c: httpx.AsyncClient, url: str, headers: dict[str, str]) -> tuple[float, float]:
    body = {
        "model": "sim-8b",
        "stream": True,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} tell me something"}],
    }
    start = time.perf_counter()
    ttft = None
    async with c.stream("POST", url, json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            # The first chunk with non-empty content (the role chunk has "").
            compact = line.replace(" ", "")
            if ttft is None and '"content":"' in compact and '"content":""' not in compact:
                ttft = time.perf_counter() - start
    end = time.perf_counter() - start
    return (ttft if ttft is not None else end), end


async def run(fleet: Fleet, n: int, concurrency: int) -> dict[str, dict[str, float]]:
    targets = {
        "direct": (f"{fleet.sim_url}/v1/chat/completions", {}),
        "jetserve": (
            f"{fleet.base_url}/v1/chat/completions",
            {"Authorization": f"Bearer {fleet.api_key}"},
        ),
    }
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in targets}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:

        async def task(name: str) -> None:
            async with sem:
                url, headers = targets[name]
                samples[name].append(await one(c, url, headers))

        for name in targets:  # warm up connections and code paths
            await one(c, *targets[name])
        # Interleave the two targets so drift on a shared machine hits both alike.
        await asyncio.gather(*(task(name) for _ in range(n) for name in targets))
    out: dict[str, dict[str, float]] = {}
    for name, vals in samples.items():
        ttfts = [t for t, _ in vals]
        e2es = [e for _, e in vals]
        out[name] = {
            "n": len(vals),
            "ttft_p50_ms": pct(ttfts, 50) * 1000,
            "ttft_p99_ms": pct(ttfts, 99) * 1000,
            "ttft_mean_ms": statistics.fmean(ttfts) * 1000,
            "e2e_p50_ms": pct(e2es, 50) * 1000,
            "e2e_p99_ms": pct(e2es, 99) * 1000,
        }
    d, j = out["direct"], out["jetserve"]
    out["added"] = {
        k: j[k] - d[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--profile", default="h100-8b")
    p.add_argument("--out", default="bench/results/ttft_overhead.json")
    args = p.parse_args()
    results: dict[str, object] = {
        "profile": args.profile,
        "requests_per_target": args.requests,
        "machine": f"{platform.machine()} cores={os.cpu_count()}",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": {},
    }
    with Fleet(FleetSpec(workers=2, profile=args.profile)) as fleet:
        for conc in (int(c) for c in args.concurrency.split(",")):
            r = asyncio.run(run(fleet, args.requests, conc))
            results["runs"][f"concurrency={conc}"] = r  # type: ignore[index]
            print(f"concurrency {conc}: " + json.dumps(r["added"]))
            print(f"  direct   {json.dumps(r['direct'])}\n  jetserve {json.dumps(r['jetserve'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

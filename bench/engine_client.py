"""What the worker's engine call costs in CPU: httpx vs the lean client (issue 14).

    .venv/bin/python bench/engine_client.py --out bench/results/profile/engine_client.json

Starts the simulator (profile ``fast``: zero engine latency) on a free port in
its own process, then streams ``--requests`` chat completions of ``--tokens``
tokens, ``--concurrency`` at a time, through ``OpenAIAdapter.generate`` as the
worker calls it: (a) over httpx (``lean_streams=False``, the path before issue
14) and (b) over ``workers.engines.lean_http``. Each variant gets a warm-up,
then ``--repeats`` timed runs, interleaved (a, b, a, b, ...) so drift on a
busy machine hits both alike; a row is the median run. CPU is this process's
``time.process_time`` (the simulator's CPU is not counted), so CPU ms/request
is what a worker would spend per request on this path. ``connects`` counts the
TCP connections each run opened (keep-alive reuse).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpcore  # noqa: E402
import httpx  # noqa: E402
import uvloop  # noqa: E402

from jetserve.services import free_port, wait_port  # noqa: E402
from workers.engines import openai as openai_adapter  # noqa: E402
from workers.engines.base import Done  # noqa: E402
from workers.engines.openai import OpenAIAdapter  # noqa: E402

# name -> lean_streams. "httpx-drain" is httpx reading past [DONE] to the
# body's end, so its connection goes back to the pool: it separates what
# keep-alive saves from what the client itself costs.
VARIANTS = {"httpx": False, "httpx-drain": False, "lean": True}
_httpx_connects = 0
_sse_data = openai_adapter._sse_data


async def _sse_data_drained(response: httpx.Response) -> AsyncGenerator[str, None]:
    """The adapter's httpx payloads, but read on to the body's end (the chunked
    terminator follows [DONE]): a fully read response keeps its connection."""
    async for line in response.aiter_lines():
        if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
            yield data


def _count_httpx_connects() -> None:
    """Wrap httpcore's connect to count TCP connections (once per connection)."""
    cls = httpcore.AsyncHTTPConnection
    original = cls._connect  # type: ignore[attr-defined]

    async def counting(self: Any, request: Any) -> Any:
        global _httpx_connects
        _httpx_connects += 1
        return await original(self, request)

    cls._connect = counting  # type: ignore[attr-defined]


async def run_once(
    adapter: OpenAIAdapter, n: int, concurrency: int, tokens: int, tag: str
) -> dict[str, float]:
    body = {
        "model": "sim-8b",
        "messages": [{"role": "user", "content": "benchmark the engine client"}],
        "max_tokens": tokens,
    }
    queue = iter(range(n))
    completion = 0

    async def lane() -> None:
        nonlocal completion
        for i in queue:
            async for event in adapter.generate("chat", body, f"{tag}-{i}", {}):
                if isinstance(event, Done):
                    completion += event.usage.completion_tokens

    lean = adapter._lean
    connects0 = lean.connects if lean is not None else _httpx_connects
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    connects = (lean.connects if lean is not None else _httpx_connects) - connects0
    return {
        "cpu_ms_per_req": cpu * 1000 / n,
        "req_s": n / wall,
        "wall_s": wall,
        "connects": connects,
        "tokens_per_req": completion / n,
    }


async def timed(
    name: str, adapter: OpenAIAdapter, args: argparse.Namespace, n: int, tag: str
) -> dict[str, float]:
    openai_adapter._sse_data = _sse_data_drained if name == "httpx-drain" else _sse_data  # type: ignore[assignment]
    try:
        return await run_once(adapter, n, args.concurrency, args.tokens, tag)
    finally:
        openai_adapter._sse_data = _sse_data  # type: ignore[assignment]


async def bench(args: argparse.Namespace, url: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    adapters = {name: OpenAIAdapter(url, lean_streams=lean) for name, lean in VARIANTS.items()}
    try:
        for name, adapter in adapters.items():
            await timed(name, adapter, args, args.warmup, f"warm-{name}")
        for r in range(args.repeats):
            for name, adapter in adapters.items():
                runs[name].append(await timed(name, adapter, args, args.requests, f"{name}-{r}"))
    finally:
        for adapter in adapters.values():
            await adapter.aclose()
    rows: dict[str, Any] = {}
    for name, rs in runs.items():
        rows[name] = {**median_by_cpu(rs), "cpu_ms_per_req_all": [x["cpu_ms_per_req"] for x in rs]}
    return rows


def median_by_cpu(rs: list[dict[str, float]]) -> dict[str, float]:
    ordered = sorted(rs, key=lambda x: x["cpu_ms_per_req"])
    return ordered[(len(ordered) - 1) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the worker's: uvloop"
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/profile/engine_client.json")
    args = p.parse_args()
    _count_httpx_connects()
    port = free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "sim", "--profile", "fast", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, 30.0, sim)
        run = uvloop.run if args.loop == "uvloop" else asyncio.run
        rows = run(bench(args, f"http://127.0.0.1:{port}"))
    finally:
        sim.terminate()
        sim.wait(10)
    saving = 1 - rows["lean"]["cpu_ms_per_req"] / rows["httpx"]["cpu_ms_per_req"]
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": rows,
        "cpu_saving": saving,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'client':<12} {'CPU ms/req':>11} {'req/s':>9} {'connects':>9} {'tokens/req':>11}")
    for name, row in rows.items():
        print(
            f"{name:<12} {row['cpu_ms_per_req']:>11.3f} {row['req_s']:>9.0f}"
            f" {row['connects']:>9.0f} {row['tokens_per_req']:>11.1f}"
        )
    print(f"lean saves {saving:.0%} CPU per request; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

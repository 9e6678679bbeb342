"""What fsync costs: JetStream ``sync_interval`` and Redis ``appendfsync``, measured.

    .venv/bin/python bench/durability.py --out bench/results/durability/results.json

JetStream (one nats-server, R1, file storage, started by jetserve.services):
- ``ledger_seq``: ledger-like records (~600 B) published one at a time, each
  awaiting its ack (a gateway appending one record);
- ``ledger_c32``: the same with 32 publishes in flight (many requests ending);
- ``wq_c32``: publish to a work-queue stream with 32 in flight, then pull and
  ack every message (the request path's queue).
Redis (one redis-server with the AOF): jetserve's ``reserve`` + ``settle`` of one
request (its Lua scripts, through redis-py as the gateway calls them), at
concurrency 1 and 32; and, where redis-benchmark is installed, raw ``INCR``
with 1 and 50 clients (the server's own ceiling). Each row is the median of
``--repeats`` runs; docs/reliability.md#durability-settings quotes the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402
from nats.js.api import RetentionPolicy, StorageType, StreamConfig  # noqa: E402

from gateway.tenancy.accounting import Accountant, Scope  # noqa: E402
from jetserve.services import start_nats, start_redis  # noqa: E402
from streams.connect import OPEN, connect  # noqa: E402

RECORD = b'{"request_id":"%s",' + b'"x":"' + b"y" * 560 + b'"}'


async def _window(n: int, inflight: int, one: Callable[[int], Awaitable[None]]) -> float:
    """Run ``one(i)`` for i < n with ``inflight`` at a time; return ops/s."""
    sem = asyncio.Semaphore(inflight)

    async def guarded(i: int) -> None:
        async with sem:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def jetstream_run(sync: str, n: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="jetserve-bench-nats-"))
    svc = start_nats(work, sync=sync)
    try:
        nc = await connect(f"nats://127.0.0.1:{svc.port}", "bench", OPEN)
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name="L", subjects=["l.*"], storage=StorageType.FILE),
        )
        await js.add_stream(
            StreamConfig(
                name="W",
                subjects=["w.*"],
                storage=StorageType.FILE,
                retention=RetentionPolicy.WORK_QUEUE,
            )
        )

        async def ledger(i: int) -> None:
            await js.publish(f"l.t{i % 8}", RECORD % str(i).encode())

        async def queue(i: int) -> None:
            await js.publish("w.interactive", RECORD % str(i).encode())

        out = {
            "ledger_seq": await _window(n // 4, 1, ledger),
            "ledger_c32": await _window(n, 32, ledger),
            "wq_publish_c32": await _window(n, 32, queue),
        }
        sub = await js.pull_subscribe("w.interactive", "workers", stream="W")
        t0, done = time.perf_counter(), 0
        while done < n:
            msgs = await sub.fetch(32, timeout=10)
            await asyncio.gather(*(m.ack_sync() for m in msgs))
            done += len(msgs)
        out["wq_pull_ack_b32"] = n / (time.perf_counter() - t0)
        await nc.close()
        return out
    finally:
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)


async def redis_run(appendfsync: str, n: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="jetserve-bench-redis-"))
    svc = start_redis(work, appendfsync=appendfsync)
    client = aioredis.Redis(port=svc.port, max_connections=64)
    try:
        acct = Accountant(client)
        scope = Scope("org", "tenant", "key")

        async def spend(_: int) -> None:
            rid = uuid.uuid4().hex
            await acct.reserve(scope, rid, 1000, 100)
            await acct.settle(rid, 700)

        out = {
            "reserve_settle_seq": await _window(n // 4, 1, spend),
            "reserve_settle_c32": await _window(n, 32, spend),
        }
        if shutil.which("redis-benchmark"):
            for clients in (1, 50):
                out[f"incr_c{clients}"] = _incr(svc.port, clients, n * 5)
        return out
    finally:
        await client.aclose()
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)


def _incr(port: int, clients: int, n: int) -> float:
    cmd = ["redis-benchmark", "-p", str(port), "-t", "incr", "-c", str(clients)]
    run = subprocess.run([*cmd, "-n", str(n), "--csv"], capture_output=True, text=True, check=True)
    row = run.stdout.strip().splitlines()[-1].split(",")  # "INCR","rps",...
    return float(row[1].strip('"'))


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}


async def main(args: argparse.Namespace) -> dict[str, object]:
    nats: dict[str, dict[str, float]] = {}
    for sync in ("always", "2m"):
        nats[sync] = _median([await jetstream_run(sync, args.n) for _ in range(args.repeats)])
    redis_rows: dict[str, dict[str, float]] = {}
    for mode in ("always", "everysec"):
        redis_rows[mode] = _median([await redis_run(mode, args.n) for _ in range(args.repeats)])

    def ratio(rows: dict[str, dict[str, float]], safe: str, fast: str) -> dict[str, float]:
        return {k: round(rows[safe][k] / rows[fast][k], 3) for k in rows[safe]}

    return {
        "what": "ops/s, median of repeats; ratio = safe setting / fast setting",
        "n": args.n,
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "tmpdir": tempfile.gettempdir(),
        },
        "nats_sync_interval": nats,
        "nats_ratio_always_vs_2m": ratio(nats, "always", "2m"),
        "redis_appendfsync": redis_rows,
        "redis_ratio_always_vs_everysec": ratio(redis_rows, "always", "everysec"),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000, help="operations per concurrent row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    ns = parser.parse_args()
    result = asyncio.run(main(ns))
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text + "\n")

"""The open-loop load generator: sends each request at its scheduled time, whether
or not earlier ones have answered, and records what it sent when.

`run_job` is the driver. `run_in_subprocess` runs it in a process of its own (so the
generator shares its event loop with nothing else: not the orchestrator, not a
fleet, not the progress bar); that process is `python -m jetserve.bench.loadgen JOB
OUT`, which reads a msgpack `Job`, prints `progress SENT DONE BAD` lines and writes a
msgpack `LoadResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import uvloop

from jetserve.bench.client import ClientPool, stream_one
from jetserve.bench.prompts import Api, api_path, request_body
from jetserve.bench.targets import Target
from jetserve.bench.timeline import Timeline
from jetserve.bench.workload import RequestSpec

OnProgress = Callable[[int, int, int], None]  # sent, done, not ok (cancelled excluded)


class Job(msgspec.Struct, kw_only=True):
    target: Target
    requests: list[RequestSpec]
    model: str
    salt: str  # makes this run's prompts its own (no prefix-cache hits across runs)
    seed: int = 0
    api: Api = "chat"
    ignore_eos: bool = True
    class_header: str = "X-Jetserve-Class"  # "" sends none
    request_timeout: float = 60.0
    drain: float = 30.0  # after the last arrival, cut what is still open
    conns_per_client: int = 10
    max_clients: int = 200
    warmup: int = 2  # requests before the clock starts, not recorded
    lead: float = 0.2  # set-up slack before the first arrival
    progress_every: float = 0.25


class LoadResult(msgspec.Struct, kw_only=True):
    timelines: list[Timeline]
    started_unix: float
    clients: int
    warmup_errors: list[str]
    cpu_s: float = 0.0  # the generator's own CPU time over the run: is it the bottleneck?


def _headers(job: Job) -> dict[str, dict[str, str]]:
    base = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    base.update(job.target.headers)
    if job.target.key:
        base["Authorization"] = f"Bearer {job.target.key}"
    out: dict[str, dict[str, str]] = {}
    for r in job.requests:
        if r.cls not in out:
            out[r.cls] = {**base, job.class_header: r.cls} if job.class_header else base
    return out


async def _warmup(job: Job, pool: ClientPool, url: str, headers: dict[str, str]) -> list[str]:
    """A few tiny requests: connections open and code paths warm before timing."""
    errors: list[str] = []
    for i in range(job.warmup):
        spec = RequestSpec(index=-1 - i, at=0.0, cls="warmup", input_tokens=8, output_tokens=4)
        body = request_body(
            spec,
            api=job.api,
            model=job.target.model or job.model,
            seed=job.seed,
            salt=f"{job.salt}w{i}",
            ignore_eos=job.ignore_eos,
        )
        slot = pool.acquire()
        try:
            now = time.perf_counter()
            tl = await stream_one(
                pool.client(slot), url, headers, body, spec, t0=now, deadline=now + 30.0
            )
        finally:
            pool.release(slot)
        if tl.outcome != "ok":
            errors.append(f"{tl.outcome} {tl.status} {tl.error}".strip())
    return errors


async def run_job(
    job: Job,
    on_progress: OnProgress | None = None,
    clock: Callable[[], float] = time.perf_counter,
    *,
    freeze_gc: bool = False,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadResult:
    model = job.target.model or job.model
    url = job.target.url + api_path(job.api)
    headers = _headers(job)
    # Encoded up front: no JSON or prompt work competes with sending on time.
    bodies = [
        request_body(
            r, api=job.api, model=model, seed=job.seed, salt=job.salt, ignore_eos=job.ignore_eos
        )
        for r in job.requests
    ]
    pool = ClientPool(job.conns_per_client, job.max_clients, transport=transport)
    timelines: list[Timeline | None] = [None] * len(job.requests)
    sent = done = bad = 0
    try:
        pool.prestart(4)
        warm_headers = next(iter(headers.values()), {})
        warmup_errors = await _warmup(job, pool, url, warm_headers) if job.requests else []
        if freeze_gc:
            # Everything built so far lives to the end: keep the collector from rescanning
            # it (full collections in mid-run would delay sends). Own process only.
            gc.collect()
            gc.freeze()
        started_unix = time.time() + job.lead
        cpu0 = time.process_time()
        t0 = clock() + job.lead
        last = job.requests[-1].at if job.requests else 0.0
        drain_deadline = t0 + last + job.drain

        async def one(i: int, req: RequestSpec) -> None:
            nonlocal sent, done, bad
            slot = pool.acquire()
            sent += 1
            try:
                tl = await stream_one(
                    pool.client(slot),
                    url,
                    headers[req.cls],
                    bodies[i],
                    req,
                    t0=t0,
                    deadline=min(clock() + job.request_timeout, drain_deadline),
                    clock=clock,
                )
            finally:
                pool.release(slot)
            timelines[i] = tl
            done += 1
            if tl.outcome not in ("ok", "cancelled"):
                bad += 1

        async def report() -> None:
            while True:
                if on_progress is not None:
                    on_progress(sent, done, bad)
                await asyncio.sleep(job.progress_every)

        reporter = asyncio.create_task(report())
        tasks: list[asyncio.Task[None]] = []
        try:
            for i, req in enumerate(job.requests):
                # Timers may fire a little early; sleep again rather than send early.
                for _ in range(3):
                    delay = t0 + req.at - clock()
                    if delay <= 0.0005:
                        break
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, req)))
            await asyncio.gather(*tasks)
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
            for t in tasks:
                t.cancel()
        if on_progress is not None:
            on_progress(sent, done, bad)
        cpu_s = time.process_time() - cpu0
    finally:
        if freeze_gc:
            gc.unfreeze()
        clients = pool.size
        await pool.aclose()
    return LoadResult(
        timelines=[t for t in timelines if t is not None],
        started_unix=started_unix,
        clients=clients,
        warmup_errors=warmup_errors,
        cpu_s=cpu_s,
    )


def run_in_subprocess(job: Job, on_progress: OnProgress | None = None) -> LoadResult:
    with tempfile.TemporaryDirectory(prefix="jetserve-bench-") as tmp:
        job_path, out_path, err_path = (Path(tmp) / n for n in ("job", "out", "stderr"))
        job_path.write_bytes(msgspec.msgpack.encode(job))
        with (
            err_path.open("wb") as err,
            subprocess.Popen(
                [sys.executable, "-m", "jetserve.bench.loadgen", str(job_path), str(out_path)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            ) as proc,
        ):
            assert proc.stdout is not None
            for line in proc.stdout:
                parts = line.split()
                if len(parts) == 4 and parts[0] == "progress" and on_progress is not None:
                    on_progress(int(parts[1]), int(parts[2]), int(parts[3]))
            rc = proc.wait()
        if rc != 0:
            tail = err_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"load generator exited with {rc}:\n{tail}")
        return msgspec.msgpack.decode(out_path.read_bytes(), type=LoadResult)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m jetserve.bench.loadgen JOB OUT", file=sys.stderr)
        return 2
    job = msgspec.msgpack.decode(Path(args[0]).read_bytes(), type=Job)

    def progress(sent: int, done: int, bad: int) -> None:
        print(f"progress {sent} {done} {bad}", flush=True)

    result = uvloop.run(run_job(job, progress, freeze_gc=True))
    Path(args[1]).write_bytes(msgspec.msgpack.encode(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

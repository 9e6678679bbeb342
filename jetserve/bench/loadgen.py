"""The open-loop load generator: sends each request at its scheduled time, whether
or not earlier ones have answered, and records what it sent when.

`run_job` drives one run through `openloop.open_loop`. `run_in_subprocess` runs
it in a process of its own (so the generator shares its event loop with nothing
else: not the orchestrator, not a fleet, not the progress bar); that process is
`python -m jetserve.bench.loadgen JOB OUT`, which reads a msgpack `Job`, prints
`progress SENT DONE BAD` lines and writes a msgpack `LoadResult`.
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
from jetserve.bench.openloop import open_loop
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
    url = job.target.url + api_path(job.api)
    headers = _headers(job)
    pool = ClientPool(job.conns_per_client, job.max_clients, transport=transport)
    sender = _Sender(job, pool, url, headers, clock)
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
        timelines = await sender.run(clock() + job.lead, on_progress)
        cpu_s = time.process_time() - cpu0
    finally:
        if freeze_gc:
            gc.unfreeze()
        clients = pool.size
        await pool.aclose()
    return LoadResult(
        timelines=timelines,
        started_unix=started_unix,
        clients=clients,
        warmup_errors=warmup_errors,
        cpu_s=cpu_s,
    )


class _Sender:
    """One run's requests through the open-loop driver, counting as they go."""

    def __init__(
        self,
        job: Job,
        pool: ClientPool,
        url: str,
        headers: dict[str, dict[str, str]],
        clock: Callable[[], float],
    ) -> None:
        self.job, self.pool, self.url, self.headers, self.clock = job, pool, url, headers, clock
        model = job.target.model or job.model
        # Encoded up front: no JSON or prompt work competes with sending on time.
        self.bodies = [
            request_body(
                r, api=job.api, model=model, seed=job.seed, salt=job.salt, ignore_eos=job.ignore_eos
            )
            for r in job.requests
        ]
        self.sent = self.done = self.bad = 0
        self.t0 = 0.0
        self.drain_deadline = 0.0

    async def run(self, t0: float, on_progress: OnProgress | None) -> list[Timeline]:
        self.t0 = t0
        last = self.job.requests[-1].at if self.job.requests else 0.0
        self.drain_deadline = t0 + last + self.job.drain
        reporter = asyncio.create_task(self._report(on_progress))
        try:
            arrivals = (r.at for r in self.job.requests)
            timelines = await open_loop(arrivals, self._one, t0=t0, clock=self.clock)
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        if on_progress is not None:
            on_progress(self.sent, self.done, self.bad)
        return timelines

    async def _one(self, i: int) -> Timeline:
        req = self.job.requests[i]
        slot = self.pool.acquire()
        self.sent += 1
        try:
            tl = await stream_one(
                self.pool.client(slot),
                self.url,
                self.headers[req.cls],
                self.bodies[i],
                req,
                t0=self.t0,
                deadline=min(self.clock() + self.job.request_timeout, self.drain_deadline),
                clock=self.clock,
            )
        finally:
            self.pool.release(slot)
        self.done += 1
        if tl.outcome not in ("ok", "cancelled"):
            self.bad += 1
        return tl

    async def _report(self, on_progress: OnProgress | None) -> None:
        while True:
            if on_progress is not None:
                on_progress(self.sent, self.done, self.bad)
            await asyncio.sleep(self.job.progress_every)


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

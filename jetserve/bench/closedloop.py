"""The closed-loop load generator of `jetserve bench capacity`: C clients, each
sending its next request as soon as its previous one has answered.

A closed loop measures capacity, not latency under a given offered load (that is
the open loop's job, ``loadgen``): the server's speed sets the arrival rate, so the
highest completion rate over the concurrency levels is what the server sustains.

The clients run for ``warmup`` seconds first (connections open, caches warm), then
the measured window of ``duration`` seconds opens and closes: the generator calls
``on_mark("begin")`` and ``on_mark("end")`` at those moments, so the orchestrator
can read every process's CPU time exactly around the window. After it, clients
send nothing more; what is in flight is let finish (it is outside the window).

Like ``loadgen``, it runs in a process of its own (``python -m
jetserve.bench.closedloop JOB OUT``, on uvloop): it prints ``mark begin``, ``mark
end`` and ``progress ELAPSED DONE BAD`` lines and writes a msgpack `ClosedResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import uvloop

from jetserve.bench.client import ClientPool, stream_one
from jetserve.bench.client_plain import complete_one
from jetserve.bench.prompts import Api, api_path, request_body
from jetserve.bench.targets import Target
from jetserve.bench.timeline import Timeline
from jetserve.bench.workload import RequestSpec

Clock = Callable[[], float]
OnMark = Callable[[str], None]  # "begin" / "end" of the measured window
OnProgress = Callable[[float, int, int], None]  # seconds into the window, done, not ok

_PLACEHOLDER = 987654321  # the request-index word of the body template
ERROR_PAUSE_S = 0.01  # after a failed request, so a server that refuses at once is not spun
AFTER_WINDOW_S = 10.0  # what is in flight when the window closes gets this long, then is cut


class ClosedJob(msgspec.Struct, kw_only=True):
    target: Target
    concurrency: int
    duration: float  # the measured window, seconds
    warmup: float = 1.0  # clients run this long before the window opens
    stream: bool = True
    input_tokens: int = 64
    max_tokens: int = 16
    model: str = "sim-8b"
    api: Api = "chat"
    ignore_eos: bool = True
    salt: str = "z"  # one word per run: no prefix-cache hits across runs
    seed: int = 0
    request_timeout: float = 60.0
    conns_per_client: int = 10
    progress_every: float = 0.25


class ClosedResult(msgspec.Struct, kw_only=True):
    timelines: list[Timeline]  # every request, times from the clients' start
    window: tuple[float, float]  # the measured window, on the same clock
    cpu_s: float  # the generator's own CPU time over the window
    clients: int  # httpx clients (pools) used
    unfinished: int = 0  # requests still open AFTER_WINDOW_S after the window: cut


def body_maker(job: ClosedJob) -> Callable[[int], bytes]:
    """Request n's body: one template encoded up front, the request's own word
    (``r<n>``, right after the run's salt, so no two prompts share a cached prefix)
    put in by a byte join: no JSON or prompt work per request."""
    spec = RequestSpec(
        index=_PLACEHOLDER,
        at=0.0,
        cls="capacity",
        input_tokens=job.input_tokens,
        output_tokens=job.max_tokens,
    )
    raw = request_body(
        spec,
        api=job.api,
        model=job.target.model or job.model,
        seed=job.seed,
        salt=job.salt,
        ignore_eos=job.ignore_eos,
    )
    if not job.stream:
        body: dict[str, Any] = msgspec.json.decode(raw)
        body["stream"] = False
        body.pop("stream_options", None)  # only allowed with stream=true
        raw = msgspec.json.encode(body)
    head, sep, tail = raw.partition(b"r%d" % _PLACEHOLDER)
    if not sep:
        raise ValueError("body template without its request word")
    return lambda n: b"%sr%d%s" % (head, n, tail)


def request_headers(job: ClosedJob) -> dict[str, str]:
    accept = "text/event-stream" if job.stream else "application/json"
    headers = {"Content-Type": "application/json", "Accept": accept, **job.target.headers}
    if job.target.key:
        headers["Authorization"] = f"Bearer {job.target.key}"
    return headers


class _Loop:
    """The C clients of one run and their counts."""

    def __init__(self, job: ClosedJob, pool: ClientPool, clock: Clock) -> None:
        self.job, self.pool, self.clock = job, pool, clock
        self.url = job.target.url + api_path(job.api)
        self.headers = request_headers(job)
        self.body = body_maker(job)
        self.timelines: list[Timeline] = []
        self.next_index = 0
        self.stop = False
        self.counting = False
        self.done = self.bad = 0
        self.t0 = 0.0

    async def client(self) -> None:
        slot = self.pool.acquire()  # held for the client's life: one keep-alive connection
        http = self.pool.client(slot)
        spec = RequestSpec(index=0, at=0.0, cls="capacity", input_tokens=0, output_tokens=0)
        try:
            while not self.stop:
                n = self.next_index
                self.next_index += 1
                deadline = self.clock() + self.job.request_timeout
                if self.job.stream:
                    tl = await stream_one(
                        http, self.url, self.headers, self.body(n), spec,
                        t0=self.t0, deadline=deadline, clock=self.clock,
                    )  # fmt: skip
                    tl.index = n
                else:
                    tl = await complete_one(
                        http, self.url, self.headers, self.body(n),
                        index=n, t0=self.t0, deadline=deadline, clock=self.clock,
                    )  # fmt: skip
                self.timelines.append(tl)
                if self.counting:
                    self.done += 1
                    self.bad += tl.outcome != "ok"
                if tl.outcome != "ok":
                    await asyncio.sleep(ERROR_PAUSE_S)
        finally:
            self.pool.release(slot)


async def run_closed(
    job: ClosedJob,
    on_mark: OnMark | None = None,
    on_progress: OnProgress | None = None,
    clock: Clock = time.perf_counter,
    *,
    freeze_gc: bool = False,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ClosedResult:
    if job.concurrency < 1 or job.duration <= 0:
        raise ValueError("concurrency must be >= 1 and duration > 0")
    conns = job.conns_per_client
    pool = ClientPool(conns, max(1, math.ceil(job.concurrency / conns)), transport=transport)
    loop = _Loop(job, pool, clock)
    tasks: list[asyncio.Task[None]] = []
    try:
        pool.prestart(pool.max_clients)
        if freeze_gc:
            gc.collect()
            gc.freeze()  # keep full collections from rescanning what lives to the end
        loop.t0 = clock()
        tasks = [asyncio.create_task(loop.client()) for _ in range(job.concurrency)]
        await asyncio.sleep(max(loop.t0 + job.warmup - clock(), 0.0))
        if on_mark is not None:
            on_mark("begin")
        begin, cpu0 = clock(), time.process_time()
        loop.counting = True
        while (left := begin + job.duration - clock()) > 0:
            await asyncio.sleep(min(job.progress_every, left))
            if on_progress is not None:
                on_progress(min(clock() - begin, job.duration), loop.done, loop.bad)
        loop.counting = False
        if on_mark is not None:
            on_mark("end")
        end, cpu_s = clock(), time.process_time() - cpu0
        loop.stop = True
        # What is in flight ends outside the window: let it finish, for a while.
        _, pending = await asyncio.wait(tasks, timeout=min(job.request_timeout, AFTER_WINDOW_S))
        for t in pending:
            t.cancel()
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if freeze_gc:
            gc.unfreeze()
        clients = pool.size
        await pool.aclose()
    return ClosedResult(
        timelines=loop.timelines,
        window=(begin - loop.t0, end - loop.t0),
        cpu_s=cpu_s,
        clients=clients,
        unfinished=len(pending),
    )


def run_closed_in_subprocess(
    job: ClosedJob,
    on_mark: Callable[[str, int], None] | None = None,  # with the generator's pid
    on_progress: OnProgress | None = None,
) -> ClosedResult:
    with tempfile.TemporaryDirectory(prefix="jetserve-bench-") as tmp:
        job_path, out_path, err_path = (Path(tmp) / n for n in ("job", "out", "stderr"))
        job_path.write_bytes(msgspec.msgpack.encode(job))
        argv = [sys.executable, "-m", "jetserve.bench.closedloop", str(job_path), str(out_path)]
        with (
            err_path.open("wb") as err,
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
        ):
            assert proc.stdout is not None
            for line in proc.stdout:
                parts = line.split()
                if len(parts) == 2 and parts[0] == "mark" and on_mark is not None:
                    on_mark(parts[1], proc.pid)
                elif len(parts) == 4 and parts[0] == "progress" and on_progress is not None:
                    on_progress(float(parts[1]), int(parts[2]), int(parts[3]))
            rc = proc.wait()
        if rc != 0:
            tail = err_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"closed-loop generator exited with {rc}:\n{tail}")
        return msgspec.msgpack.decode(out_path.read_bytes(), type=ClosedResult)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m jetserve.bench.closedloop JOB OUT", file=sys.stderr)
        return 2
    job = msgspec.msgpack.decode(Path(args[0]).read_bytes(), type=ClosedJob)

    def mark(name: str) -> None:
        print(f"mark {name}", flush=True)

    def progress(elapsed: float, done: int, bad: int) -> None:
        print(f"progress {elapsed:.2f} {done} {bad}", flush=True)

    result = uvloop.run(run_closed(job, mark, progress, freeze_gc=True))
    Path(args[1]).write_bytes(msgspec.msgpack.encode(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`jetserve bench embed`: embeddings on a real model, direct against through jetserve.

It serves all-MiniLM-L6-v2 with vLLM's pooling runner (``bench/peers/vllm.sh
serve-embed``, or ``--engine URL`` for one already running) and puts one
jetserve fleet (gateway + one worker) in front of it per arm:

- ``direct``: the engine itself;
- ``jetserve``: worker micro-batching off (the default for vLLM, which batches
  concurrent calls itself);
- ``jetserve-batched``: batching on, usage counted in-process (``--tokenizer``);
- ``jetserve-batched-tokenize`` (opt-in): batching on, usage counted by one
  engine ``/tokenize`` call per input, the path issue 17 measured;
- ``baseline`` (with ``--baseline DIR``): as ``jetserve``, but its gateway and
  worker run the code of another checkout (``git archive main | tar -x -C DIR``),
  so a change is measured against what it changes in the same run.

Each arm runs a closed loop (C clients, each sending its next request when the
last one answered) of single-input and 8-input requests. Arms alternate within
each round (the order rotates), so a noisy neighbour on the shared machine hits
all of them alike; the figures that count are ratios against ``direct`` in the
same round. Before measuring, it checks that every jetserve arm returns vectors
bit-identical to the engine's own and the same ``prompt_tokens``, alone and in
concurrent (batched) requests.

Writes ``embed.json`` (every run, with the CPU seconds of the engine, each
fleet's gateway, worker and bus (nats-server, redis-server), and the rest of
the machine over its window) and ``summary.md`` under ``--out``, which gives the
CPU per request of each arm's own processes beside its ratio: on a machine
whose cores the engine itself fills (vLLM's CPU build), every CPU-millisecond
the path spends is one the engine does not get, so a gap the path's CPU
accounts for is contention, and the rest is waiting. ``--wait-quiet CORES``
holds each run until other processes use at most that many cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import uvloop

from jetserve.bench.cpu import CpuMeter, keep_off, wait_quiet
from jetserve.bench.stages import STAGES, read_spans, request_stages, stage_summary
from jetserve.fleet import Fleet, FleetSpec
from jetserve.services import (
    NATS_SYNC_DEFAULT,
    REDIS_APPENDFSYNC,
    REDIS_APPENDFSYNC_DEFAULT,
    check_nats_sync,
    free_port,
)
from workers.engines.lean_http import LeanClient
from workers.engines.vllm_metrics import vllm_sums
from workers.errors import EngineError

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(
    os.environ.get("JETSERVE_VLLM_PEERS")
    or os.environ.get("JETSERVE_PEERS")
    or Path.home() / ".cache/jetserve-peers"
)
DEFAULT_TOKENIZER = PEERS / "minilm/all-MiniLM-L6-v2"
ARMS = (
    "direct",
    "jetserve",
    "jetserve-batched",
    "jetserve-batched-tokenize",
    "baseline",
    "direct-pause",
)
DIRECT_ARMS = ("direct", "direct-pause")  # the engine itself, no fleet
# The engine's max_num_seqs (bench/peers/vllm.sh serve-embed sets it; vLLM's own
# default on a CPU), which each worker is told as --max-inflight: the worker's
# default 16 would cap the engine's batch below what direct clients get.
ENGINE_MAX_NUM_SEQS = 128
WORKER_ARGS = {
    "jetserve": ["--embed-batching", "off"],
    "baseline": ["--embed-batching", "off"],
    "jetserve-batched": ["--embed-batching", "on", "--tokenizer", "{tokenizer}"],
    "jetserve-batched-tokenize": ["--embed-batching", "on"],
}
WORDS = (
    "the",
    "a",
    "model",
    "engine",
    "request",
    "token",
    "vector",
    "queue",
    "worker",
    "gateway",
    "batch",
    "latency",
    "stream",
    "cache",
    "prefix",
    "input",
    "output",
    "server",
    "client",
    "deadline",
    "budget",
    "tenant",
    "route",
    "replica",
    "pool",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "river",
    "mountain",
    "city",
    "night",
    "morning",
    "coffee",
)


# The process groups whose CPU per request is reported, in the table's order.
CPU_GROUPS = ("engine", "gateway", "worker", "bus", "client")


class Run(msgspec.Struct, kw_only=True):
    arm: str
    inputs: int  # per request
    round: int
    requests: int
    items: int
    errors: int
    window_s: float
    items_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    cpu_s: dict[str, float]  # per process group over the window
    other_cores_before: float | None = None  # other processes' use as the run began
    # The engine's own scheduler steps over the run (warm-up included) and the
    # tokens it took per step: its batch, from vLLM's iteration_tokens_total.
    engine_steps: int | None = None
    tokens_per_step: float | None = None


class ArmSummary(msgspec.Struct, kw_only=True):
    items_per_s: float  # median over rounds
    p50_ms: float | None
    p99_ms: float | None
    ratio_to_direct: float | None  # median over rounds of arm / direct in that round
    ratio_min: float | None
    # CPU ms per request (median over rounds): the engine and this arm's own
    # processes (gateway, worker, bus); ``other``: everything else, in cores.
    cpu_ms_per_request: dict[str, float] = {}
    other_cores: float | None = None
    tokens_per_step: float | None = None  # the engine's batch, median over rounds


class Check(msgspec.Struct, kw_only=True):
    arm: str
    requests: int
    vectors_identical: bool
    prompt_tokens_exact: bool


class EmbedResults(msgspec.Struct, kw_only=True):
    command: str
    when: str
    engine: str
    model: str
    tokenizer: str
    cpus: int | None
    concurrency: int
    engine_cpus: str | None = None  # JETSERVE_VLLM_CPUS: the engine's taskset list
    path_cpus: list[int] | None = None  # the fleets' and load generator's, when pinned
    nats_sync: str = NATS_SYNC_DEFAULT  # the fleets' durability settings
    redis_appendfsync: str = REDIS_APPENDFSYNC_DEFAULT
    worker_max_inflight: int | None = None  # each worker's --max-inflight (None: 16, before)
    pause_ms: float | None = None  # the direct-pause arm's mean pause (None: no such arm)
    # With --stages: arm -> p50/p90 ms of each hop (jetserve/bench/stages.py).
    stages: dict[str, dict[str, Any]] = {}
    duration_s: float
    warmup_s: float
    rounds: int
    checks: list[Check]
    runs: list[Run]
    summary: dict[str, dict[str, ArmSummary]]  # inputs per request -> arm -> figures


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default=None, help="an embedding engine already running (URL)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="the model's directory")
    p.add_argument("--arms", default=",".join(ARMS[:3]), help=f"from {','.join(ARMS)}")
    p.add_argument("--inputs", default="1,8", help="inputs per request, one figure each")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument(
        "--client", choices=("lean", "httpx"), default="lean",
        help="the load generator's HTTP client (lean: the worker's; httpx: more CPU per request)",
    )  # fmt: skip
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per run")
    p.add_argument("--rounds", type=int, default=3, help="each arm this many times, alternated")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="CORES",
        help="before each run, wait until other processes use <= CORES (a shared machine)",
    )
    p.add_argument("--wait-quiet-max", type=float, default=120.0, help="... for at most this long")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="another checkout's code for the baseline arm (added to --arms)",
    )
    p.add_argument(
        "--nats-sync", default=NATS_SYNC_DEFAULT,
        help="the fleets' JetStream fsync policy (always, or a duration: 2m is nats-server's own)",
    )  # fmt: skip
    p.add_argument(
        "--redis-appendfsync", default=REDIS_APPENDFSYNC_DEFAULT, choices=REDIS_APPENDFSYNC,
        help="the fleets' Redis AOF fsync policy",
    )  # fmt: skip
    p.add_argument(
        "--max-inflight", type=int, default=ENGINE_MAX_NUM_SEQS,
        help="each worker's --max-inflight: the engine's max_num_seqs (bench/peers/vllm.sh)",
    )  # fmt: skip
    p.add_argument(
        "--stages", action="store_true",
        help="export the fleets' spans and report where each request's time went (a little slower)",
    )  # fmt: skip
    p.add_argument(
        "--pause-ms", type=float, default=5.0,
        help="the direct-pause arm: each client's mean pause after an answer (ms)",
    )  # fmt: skip
    p.add_argument("--out", default="bench/results/embed-minilm")


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24)))


def bodies(model: str, inputs: int, seed: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    while True:
        texts = [sentence(rng) for _ in range(inputs)]
        value: str | list[str] = texts[0] if inputs == 1 else texts
        yield msgspec.json.encode({"model": model, "input": value})


@contextlib.contextmanager
def vllm_engine(log: Path) -> Iterator[tuple[str, int]]:
    """all-MiniLM-L6-v2 on vLLM's pooling runner, on a free port, until the block
    ends: its URL and process id."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(ROOT / "bench/peers/vllm.sh"), "serve-embed", str(port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({proc.returncode}); see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not answer /health in 600 s; see {log}")
            time.sleep(1.0)  # polling a process start-up: nothing to wait on but /health
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Item(msgspec.Struct):
    index: int


class _Reply(msgspec.Struct):
    data: list[_Item]  # the vectors are skipped, not built: only the count is used


_REPLY = msgspec.json.Decoder(_Reply)


async def closed_loop(
    url: str, headers: dict[str, str], make: Iterator[bytes], clients: int, warmup: float,
    duration: float, client_kind: str = "lean", pause_s: float = 0.0,
) -> tuple[list[float], int, int]:  # fmt: skip
    """Latencies (s) and error count of requests completed inside the window, and
    the inputs they carried. The load comes from ``clients`` keep-alive
    connections through the lean HTTP client (``client_kind="httpx"``: httpx,
    which cost this process 0.8-1.2 ms of CPU per request against 0.12-0.18 ms,
    taken from the cores the path shares). ``pause_s``: each client waits a
    random time of that mean (exponential, seeded) after each answer: latency
    that costs no CPU, as a path's would add (the ``direct-pause`` arm)."""
    pauses = random.Random(7)
    headers = {"Content-Type": "application/json", **headers}
    lat: list[float] = []
    errors = items = 0
    start = time.monotonic()
    begin, end = start + warmup, start + warmup + duration
    if client_kind == "httpx":
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        hx = httpx.AsyncClient(base_url=url, timeout=120, limits=limits)

        async def post(body: bytes) -> tuple[int, bytes]:
            r = await hx.post("/v1/embeddings", content=body, headers=headers)
            return r.status_code, r.content

        close = hx.aclose
    else:
        lean = LeanClient(url, max_connections=clients)

        async def post(body: bytes) -> tuple[int, bytes]:
            async with asyncio.timeout(120):
                return await lean.post("/v1/embeddings", body, headers)

        close = lean.aclose

    async def one() -> None:
        nonlocal errors, items
        while (t0 := time.monotonic()) < end:
            try:
                status, data = await post(next(make))
                n = len(_REPLY.decode(data).data) if status == 200 else 0
                ok = status == 200
            except (httpx.HTTPError, EngineError, TimeoutError, msgspec.DecodeError):
                ok, n = False, 0
            t1 = time.monotonic()
            if begin <= t0 and t1 <= end:
                if ok:
                    lat.append(t1 - t0)
                    items += n
                else:
                    errors += 1
            if pause_s > 0:  # never past the window's end
                left = max(0.0, end - time.monotonic())
                await asyncio.sleep(min(pauses.expovariate(1 / pause_s), left))

    try:
        await asyncio.gather(*(one() for _ in range(clients)))
    finally:
        await close()
    return lat, items, errors


def scrape_steps(engine: str) -> tuple[float, float] | None:
    """The engine's (steps, tokens) so far; None when its metrics do not say."""
    try:
        r = httpx.get(f"{engine}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return engine_steps(r.text) if r.status_code == 200 else None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def check(arm: str, url: str, headers: dict[str, str], engine: str, model: str) -> Check:
    """Vectors and prompt_tokens through ``url`` equal the engine's own: single and
    8-input requests, one at a time and 16 at once (batched where the arm batches)."""
    rng = random.Random(7)
    reqs: list[dict[str, Any]] = [{"model": model, "input": sentence(rng)} for _ in range(8)] + [
        {"model": model, "input": [sentence(rng) for _ in range(8)]} for _ in range(8)
    ]
    async with httpx.AsyncClient(timeout=120) as c:
        direct = [(await c.post(f"{engine}/v1/embeddings", json=b)).json() for b in reqs]
        alone = [
            (await c.post(f"{url}/v1/embeddings", json=b, headers=headers)).json() for b in reqs
        ]
        together = await asyncio.gather(
            *(c.post(f"{url}/v1/embeddings", json=b, headers=headers) for b in reqs)
        )
    got = [*alone, *(r.json() for r in together)]
    want = [*direct, *direct]
    return Check(
        arm=arm,
        requests=len(got),
        vectors_identical=all(
            [d["embedding"] for d in g["data"]] == [d["embedding"] for d in w["data"]]
            for g, w in zip(got, want, strict=True)
        ),
        prompt_tokens_exact=all(
            g["usage"]["prompt_tokens"] == w["usage"]["prompt_tokens"]
            for g, w in zip(got, want, strict=True)
        ),
    )


def summarise(
    runs: list[Run], arms: list[str], shapes: list[int]
) -> dict[str, dict[str, ArmSummary]]:
    out: dict[str, dict[str, ArmSummary]] = {}
    for n in shapes:
        direct = {r.round: r.items_per_s for r in runs if r.inputs == n and r.arm == "direct"}
        out[str(n)] = {}
        for arm in arms:
            mine = [r for r in runs if r.inputs == n and r.arm == arm]
            ratios = [r.items_per_s / direct[r.round] for r in mine if direct.get(r.round)]
            p50s = [r.p50_ms for r in mine if r.p50_ms is not None]
            p99s = [r.p99_ms for r in mine if r.p99_ms is not None]
            others = [r.cpu_s["other"] / r.window_s for r in mine if "other" in r.cpu_s]
            steps = [r.tokens_per_step for r in mine if r.tokens_per_step is not None]
            out[str(n)][arm] = ArmSummary(
                items_per_s=round(statistics.median(r.items_per_s for r in mine), 1),
                p50_ms=round(statistics.median(p50s), 1) if p50s else None,
                p99_ms=round(statistics.median(p99s), 1) if p99s else None,
                ratio_to_direct=round(statistics.median(ratios), 3) if ratios else None,
                ratio_min=round(min(ratios), 3) if ratios else None,
                cpu_ms_per_request=cpu_per_request(mine, arm),
                other_cores=round(statistics.median(others), 2) if others else None,
                tokens_per_step=round(statistics.median(steps), 1) if steps else None,
            )
    return out


def engine_steps(text: str) -> tuple[float, float] | None:
    """(steps, tokens) the engine has scheduled so far, from its metrics text
    (vLLM's ``iteration_tokens_total`` histogram); None when it has none."""
    sums, _ = vllm_sums(text)
    count = sums.get("vllm:iteration_tokens_total_count")
    total = sums.get("vllm:iteration_tokens_total_sum")
    return None if count is None or total is None else (count, total)


def step_delta(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> tuple[int | None, float | None]:
    """Steps between two readings and the tokens per step over them."""
    if before is None or after is None or after[0] <= before[0]:
        return None, None
    steps = after[0] - before[0]
    return int(steps), round((after[1] - before[1]) / steps, 1)


def cpu_per_request(runs: list[Run], arm: str) -> dict[str, float]:
    """Median over ``runs`` of each of the arm's own process groups' CPU ms per
    request: ``engine``, ``client`` (the load generator) and, through a fleet, its
    ``gateway``, ``worker``, ``bus``."""
    per: dict[str, list[float]] = {}
    for r in runs:
        if not r.requests:
            continue
        for group, cpu in r.cpu_s.items():
            name = "engine" if group == "engine" else group.removeprefix(f"{arm}:")
            if name in CPU_GROUPS:
                per.setdefault(name, []).append(1000 * cpu / r.requests)
    return {k: round(statistics.median(v), 2) for k, v in per.items()}


def markdown(res: EmbedResults) -> str:
    lines = [
        f"# Embeddings: {res.model} on vLLM's pooling runner, direct vs through jetserve",
        "",
        f"`{res.command}` at {res.when}: {res.concurrency} closed-loop clients, "
        f"{res.rounds} rounds of {res.duration_s:g} s per arm (arms alternated), "
        f"{res.cpus} CPUs shared by the engine, the fleets and the load generator"
        + (
            "."
            if res.path_cpus is None
            else f": the engine on CPUs {res.engine_cpus}, the rest on {res.path_cpus}."
        ),
        "",
        f"The fleets' durability: JetStream sync_interval {res.nats_sync}, Redis "
        f"appendfsync {res.redis_appendfsync}."
        + (
            ""
            if res.worker_max_inflight is None
            else f" Each worker: --max-inflight {res.worker_max_inflight}."
        ),
        "",
        "CPU ms per request: the engine's, and the arm's own processes' (gateway, "
        "worker, bus = nats-server + redis-server), and the load generator's (client); "
        "other: the rest of the machine, in cores.",
        "",
        "Engine tokens/step: the mean batch of vLLM's scheduler steps over the runs "
        "(iteration_tokens_total), median over rounds.",
        "",
    ]
    if res.pause_ms is not None:
        lines += [
            f"direct-pause: direct clients that pause a random time (exponential, mean "
            f"{res.pause_ms:g} ms) after each answer: a path's latency without its CPU. "
            "Its p50 and p99 leave the pause out.",
            "",
        ]
    lines += [
        "| inputs/request | arm | items/s (median) | vs direct (median, min) | p50 ms | p99 ms "
        "| CPU ms/request: engine, gateway, worker, bus, client | other cores "
        "| engine tokens/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, arms in res.summary.items():
        for arm, s in arms.items():
            ratio = (
                "-" if s.ratio_to_direct is None else f"{s.ratio_to_direct:.2f}, {s.ratio_min:.2f}"
            )
            cpu = ", ".join(
                f"{s.cpu_ms_per_request[k]:g}" if k in s.cpu_ms_per_request else "-"
                for k in CPU_GROUPS
            )
            lines.append(
                f"| {n} | {arm} | {s.items_per_s} | {ratio} | {s.p50_ms} | {s.p99_ms} "
                f"| {cpu} | {s.other_cores} | {s.tokens_per_step or '-'} |"
            )
    if res.stages:
        lines += [
            "",
            "Where each request's time went (ms, p50 / p90; spans exported, every shape "
            "together; jetserve/bench/stages.py):",
            "",
            "| arm | requests | " + " | ".join(STAGES) + " |",
            "|---|---|" + "---|" * len(STAGES),
        ]
        for arm, st in res.stages.items():
            cells = [f"{st[k]['p50']:g} / {st[k]['p90']:g}" if k in st else "-" for k in STAGES]
            lines.append(f"| {arm} | {st.get('requests', 0)} | " + " | ".join(cells) + " |")
    lines += ["", "Checks against the engine's own answers:", ""]
    for c in res.checks:
        lines.append(
            f"- {c.arm}: {c.requests} requests, vectors identical: {c.vectors_identical}, "
            f"prompt_tokens exact: {c.prompt_tokens_exact}"
        )
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def baseline_code(src: str | None) -> Iterator[None]:
    """While a fleet starts, its processes import jetserve from ``src``: they
    inherit the environment, where PYTHONPATH comes before the installed checkout,
    and PYTHONSAFEPATH keeps ``python -m`` from putting the working directory (this
    checkout, most likely) before both."""
    if src is None:
        yield
        return
    if not (Path(src) / "jetserve" / "__init__.py").is_file():
        raise ValueError(f"--baseline {src}: no jetserve package there")
    set_now = {"PYTHONPATH": str(Path(src).resolve()), "PYTHONSAFEPATH": "1"}
    before = {k: os.environ.get(k) for k in set_now}
    os.environ.update(set_now)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cmd_embed(args: argparse.Namespace, argv: list[str]) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.baseline and "baseline" not in arms:
        arms.append("baseline")
    if "baseline" in arms and not args.baseline:
        raise ValueError("the baseline arm needs --baseline DIR")
    unknown = set(arms) - set(ARMS)
    if unknown or "direct" not in arms:
        raise ValueError(f"arms must include direct and come from {ARMS}; got {arms}")
    shapes = [int(x) for x in args.inputs.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # vllm.sh pins the engine itself (taskset): this process and its children
    # take the other cores.
    path_cpus = keep_off(os.environ.get("JETSERVE_VLLM_CPUS"))
    if path_cpus is not None:
        print(f"fleets and load generator on CPUs {path_cpus}", flush=True)
    with contextlib.ExitStack() as stack:
        if args.engine:
            engine, engine_pids = args.engine.rstrip("/"), []
        else:
            # Its log stays outside the results (megabytes): the path is printed.
            log = Path(tempfile.mkdtemp(prefix="jetserve-embed-")) / "vllm.log"
            print(f"starting vLLM (log: {log})", flush=True)
            engine, pid = stack.enter_context(vllm_engine(log))
            engine_pids = [pid]  # its engine-core process is a descendant: counted
        model = str(httpx.get(f"{engine}/v1/models", timeout=10).json()["data"][0]["id"])
        version = httpx.get(f"{engine}/version", timeout=10).json().get("version", "?")
        fleets: dict[str, Fleet] = {}
        for arm in arms:
            if arm in DIRECT_ARMS:
                continue
            wargs = [a.format(tokenizer=args.tokenizer) for a in WORKER_ARGS[arm]]
            wargs += ["--max-inflight", str(args.max_inflight)]
            spec = FleetSpec(
                workers=1, engine_url=engine, model=model, worker_args=wargs,
                gateway_args=["--embedding-models", model],
                nats_sync=check_nats_sync(args.nats_sync),
                redis_appendfsync=args.redis_appendfsync,
                export_spans=args.stages,
            )  # fmt: skip
            with baseline_code(args.baseline if arm == "baseline" else None):
                fleets[arm] = stack.enter_context(Fleet(spec))
        targets: dict[str, tuple[str, dict[str, str]]] = {a: (engine, {}) for a in DIRECT_ARMS} | {
            arm: (f.base_url, {"Authorization": f"Bearer {f.api_key}"}) for arm, f in fleets.items()
        }
        checks = [
            asyncio.run(check(arm, url, hdrs, engine, model))
            for arm, (url, hdrs) in targets.items()
            if arm in fleets
        ]
        groups = {"engine": engine_pids} | {
            f"{arm}:{kind}": pids
            for arm, f in fleets.items()
            for kind, pids in (
                ("gateway", [p.proc.pid for p in f.gateways]),
                ("worker", [p.proc.pid for p in f.workers]),
                ("bus", [s.proc.pid for s in (*f.nats_nodes, f.redis) if s is not None]),
            )
        }
        meter = CpuMeter(groups)
        runs: list[Run] = []
        for rnd in range(args.rounds):
            for n in shapes:
                order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
                for arm in order:
                    url, hdrs = targets[arm]
                    make = bodies(model, n, seed=1000 * rnd + n)
                    other = None
                    if args.wait_quiet > 0:
                        other = wait_quiet(meter, args.wait_quiet, args.wait_quiet_max)
                    steps_before = scrape_steps(engine)
                    before, own = meter.sample(), time.process_time()
                    lat, items, errors = uvloop.run(  # as the fleet's own processes
                        closed_loop(
                            url,
                            hdrs,
                            make,
                            args.concurrency,
                            args.warmup,
                            args.duration,
                            args.client,
                            args.pause_ms / 1000 if arm == "direct-pause" else 0.0,
                        )
                    )
                    cpu = CpuMeter.delta(before, meter.sample())
                    cpu["client"] = round(time.process_time() - own, 3)  # the load generator
                    n_steps, per_step = step_delta(steps_before, scrape_steps(engine))
                    run = Run(
                        arm=arm, inputs=n, round=rnd, requests=len(lat), items=items,
                        errors=errors, window_s=args.duration,
                        items_per_s=round(items / args.duration, 1),
                        p50_ms=pct(lat, 0.5), p99_ms=pct(lat, 0.99), cpu_s=cpu,
                        other_cores_before=None if other is None else round(other, 2),
                        engine_steps=n_steps, tokens_per_step=per_step,
                    )  # fmt: skip
                    runs.append(run)
                    print(
                        f"round {rnd} inputs {n} {arm}: {run.items_per_s} items/s, "
                        f"p50 {run.p50_ms} ms, p99 {run.p99_ms} ms, errors {errors}",
                        flush=True,
                    )
        stages = {
            arm: dict(stage_summary(request_stages(read_spans(f.workdir.glob("*.spans.jsonl")))))
            for arm, f in fleets.items()
            if args.stages
        }
    res = EmbedResults(
        command="jetserve bench " + " ".join(argv),
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        engine=f"vLLM {version}",
        model=model,
        tokenizer=args.tokenizer,
        cpus=os.cpu_count(),
        concurrency=args.concurrency,
        engine_cpus=os.environ.get("JETSERVE_VLLM_CPUS"),
        path_cpus=path_cpus,
        nats_sync=args.nats_sync,
        redis_appendfsync=args.redis_appendfsync,
        worker_max_inflight=args.max_inflight,
        pause_ms=args.pause_ms if "direct-pause" in arms else None,
        stages=stages,
        duration_s=args.duration,
        warmup_s=args.warmup,
        rounds=args.rounds,
        checks=checks,
        runs=runs,
        summary=summarise(runs, arms, shapes),
    )
    (out / "embed.json").write_bytes(msgspec.json.format(msgspec.json.encode(res)) + b"\n")
    (out / "summary.md").write_text(markdown(res))
    print(markdown(res))
    print(f"wrote {out / 'embed.json'} and {out / 'summary.md'}")
    bad = [c.arm for c in checks if not (c.vectors_identical and c.prompt_tokens_exact)]
    if bad:
        print(
            f"jetserve bench embed: answers differ from the engine's through {bad}", file=sys.stderr
        )
        return 1
    return 0

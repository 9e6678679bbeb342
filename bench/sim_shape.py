"""Shape check: the simulator's step model against a real vLLM (the CPU peer).

    bench/peers/vllm.sh install                               # once: ~3.4 GB, a few minutes
    .venv/bin/python bench/sim_shape.py --start-vllm          # starts vLLM, measures, stops it
    .venv/bin/python bench/sim_shape.py --vllm-url http://127.0.0.1:18000   # one already up
    .venv/bin/python bench/sim_shape.py --rescore               # re-score, re-plot shape.json

Both targets are measured the same way, one after the other on the same machine:
the real vLLM CPU engine (bench/peers/vllm.sh: a tiny random Llama) and ``jetserve sim
--profile cpu-tiny`` (started here, alone on the machine), both with --max-num-seqs 16
(the peer's recipe runs 4) so that the batch can grow:

(a) TTFT as concurrent prompt load rises: 1, 2, 4, 8, 16 streamed /v1/completions sent
    at once, each a 400-token prompt of random token ids (no prefix-cache hits), 4
    tokens;
(b) ITL as the batch grows: 1, 2, 4, 8, 16 concurrent completions of 200 tokens
    (ignore_eos, not streamed) after a 16-token prompt.

TTFT is reported as the client sees it (it includes vLLM's API server, where
concurrent requests queue too) and as the engine timed it, ITL as the engine timed it:
the mean of its own histogram over the phase, from /metrics (vLLM takes both from its
engine core's step timestamps). The targets are measured in turn, --repeat times
each; a point is the median over the repeats. The claim is the shape, for both: TTFT
rises with concurrent prompt load, ITL rises with the batch (a trend: >= 1.2x from
the first point to the last, Spearman rho >= 0.8). Writes
bench/results/sim-shape/shape.json and shape.png (matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/results/sim-shape"
CONCURRENCY = (1, 2, 4, 8, 16)
BATCH = (1, 2, 4, 8, 16)
MAX_NUM_SEQS = "16"  # the peer's recipe runs 4; 16 lets the batch grow past it
PROMPT_LEN = 400
ITL_TOKENS = 200
VOCAB = (16, 2000)  # token ids both the tiny model (2048) and the simulator accept


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_up(url: str, within: float, proc: subprocess.Popen[bytes] | None) -> None:
    end = time.monotonic() + within
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as c:
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
            with contextlib.suppress(httpx.TransportError):
                if (await c.get("/health")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not up after {within:.0f} s")


@contextlib.contextmanager
def started(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server process in its own session; stopped (SIGTERM, then SIGKILL) on exit."""
    with log.open("ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Client:
    def __init__(self, url: str, model: str, seed: int) -> None:
        self.http = httpx.AsyncClient(
            base_url=url, timeout=120.0, limits=httpx.Limits(max_connections=64)
        )
        self.model = model
        self.rng = random.Random(seed)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(*VOCAB) for _ in range(n)]

    async def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        """(TTFT, the token chunks' arrival times), in seconds from the send."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        t0 = time.perf_counter()
        times: list[float] = []
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
            # Count events in the raw bytes: no JSON parsing, so the client (on the same
            # cores as the engine) stays light. Without include_usage, every JSON event
            # carries a token.
            async for chunk in r.aiter_raw():
                now = time.perf_counter() - t0
                times += [now] * chunk.count(b"data: {")
        if not times:
            raise RuntimeError("no token in the stream")
        return times[0], times

    async def whole(self, prompt: list[int], max_tokens: int) -> None:
        """A completion not streamed: the engine decodes as it would streamed, and the
        API server is spared an SSE event per token (on 2 cores, vLLM's own API server
        falls behind 8-16 streams and delivers them in bursts)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0}  # fmt: skip
        r = await self.http.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]!r}")

    async def close(self) -> None:
        await self.http.aclose()


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "mean_ms": 1000 * statistics.mean(xs),
        "median_ms": 1000 * statistics.median(xs),
        "p90_ms": 1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))],
    }


TTFT_METRIC = "vllm:time_to_first_token_seconds"
ITL_METRIC = "vllm:inter_token_latency_seconds"


async def histograms(c: Client) -> dict[str, tuple[float, float]]:
    """(sum, count) of the engine's TTFT and ITL histograms, from its /metrics."""
    text = (await c.http.get("/metrics")).text
    out: dict[str, tuple[float, float]] = {}
    for name in (TTFT_METRIC, ITL_METRIC):
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(name + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_count"):
                count += float(line.rsplit(" ", 1)[1])
        out[name] = (total, count)
    return out


def _engine_mean(before: dict[str, Any], after: dict[str, Any], name: str) -> float:
    (s0, n0), (s1, n1) = before[name], after[name]
    return 1000 * (s1 - s0) / max(n1 - n0, 1)


async def measure(url: str, model: str, rounds: int, seed: int) -> dict[str, Any]:
    """Client-side numbers, and the engine's own (the means of its TTFT and ITL
    histograms over each phase: vLLM times them from its engine core's step
    timestamps, so a busy client or API server does not blur them)."""
    c = Client(url, model, seed)
    load0 = os.getloadavg()[0]  # the machine is shared: how busy it was, start and end
    try:
        for _ in range(3):  # warm-up (vLLM compiles and caches on its first requests)
            await c.stream(c.prompt(PROMPT_LEN), 8)
        ttft: dict[str, Any] = {}
        for n in CONCURRENCY:
            got: list[float] = []
            before = await histograms(c)
            for _ in range(rounds):
                res = await asyncio.gather(*(c.stream(c.prompt(PROMPT_LEN), 4) for _ in range(n)))
                got += [t for t, _ in res]
                await asyncio.sleep(0.2)
            ttft[str(n)] = {
                **_summary(got),
                "engine_mean_ms": _engine_mean(before, await histograms(c), TTFT_METRIC),
            }
            v = ttft[str(n)]
            print(f"  ttft  c={n}: client median {v['median_ms']:.1f} ms, "
                  f"engine mean {v['engine_mean_ms']:.1f} ms", flush=True)  # fmt: skip
        itl: dict[str, Any] = {}
        for b in BATCH:
            before = await histograms(c)
            t0 = time.perf_counter()
            for _ in range(rounds):
                await asyncio.gather(*(c.whole(c.prompt(16), ITL_TOKENS) for _ in range(b)))
                await asyncio.sleep(0.2)
            itl[str(b)] = {
                "n": rounds * b,
                "engine_mean_ms": _engine_mean(before, await histograms(c), ITL_METRIC),
                "seconds": time.perf_counter() - t0,
            }
            v = itl[str(b)]
            print(f"  itl   b={b}: engine mean {v['engine_mean_ms']:.2f} ms", flush=True)
        return {
            "url": url,
            "model": model,
            "ttft": ttft,
            "itl": itl,
            "loadavg_1m": [load0, os.getloadavg()[0]],
        }
    finally:
        await c.close()


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each point: the median over the runs of every number, and the runs themselves."""
    out: dict[str, Any] = {"url": runs[0]["url"], "model": runs[0]["model"], "runs": runs}
    for key in ("ttft", "itl"):
        out[key] = {
            point: {
                field: statistics.median(r[key][point][field] for r in runs)
                for field in runs[0][key][point]
            }
            for point in runs[0][key]
        }
    out["loadavg_1m"] = [x for r in runs for x in r["loadavg_1m"]]
    return out


def trend(series: dict[str, Any], key: str) -> dict[str, Any]:
    """How a series moves with the load: last / first, Spearman's rank correlation with
    the load, strictly increasing or not. It rises if it ends >= 1.2x where it started
    with rho >= 0.8: one noisy point on a shared machine does not undo a trend."""
    values = [v[key] for v in series.values()]
    n = len(values)
    ranks = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: values[i]))}
    rho = 1 - 6 * sum((ranks[i] - i) ** 2 for i in range(n)) / (n * (n * n - 1))
    ratio = values[-1] / values[0]
    return {
        "key": key,
        "ratio": round(ratio, 3),
        "spearman": round(rho, 3),
        "strictly_increasing": all(b > a for a, b in itertools.pairwise(values)),
        "rises": ratio >= 1.2 and rho >= 0.8,
    }


def score(result: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "ttft_client": trend(t["ttft"], "median_ms"),
            "ttft_engine": trend(t["ttft"], "engine_mean_ms"),
            "itl_engine": trend(t["itl"], "engine_mean_ms"),
        }
        for name, t in result["targets"].items()
    }


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = {"vllm": ("vLLM CPU, tiny model", "C0"), "sim": ("simulator, cpu-tiny", "C1")}
    for name, (label, color) in names.items():
        t = result["targets"].get(name)
        if t is None:
            continue
        for ax, key in zip(axes, ("ttft", "itl"), strict=True):
            xs = [int(k) for k in t[key]]
            ax.plot(xs, [v["engine_mean_ms"] for v in t[key].values()], "o-", color=color,
                    label=f"{label}: engine mean")  # fmt: skip
            if key == "ttft":
                ax.plot(xs, [v["median_ms"] for v in t[key].values()], "x:", color=color,
                        label=f"{label}: client median")  # fmt: skip
    axes[0].set(title=f"TTFT vs concurrent {PROMPT_LEN}-token prompts",
                xlabel="concurrent requests", ylabel="TTFT (ms)",
                xticks=list(CONCURRENCY))  # fmt: skip
    axes[1].set(title=f"ITL vs decode batch ({ITL_TOKENS}-token streams)",
                xlabel="concurrent streams", ylabel="ITL (ms)", xticks=list(BATCH))  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def main_async(ns: argparse.Namespace) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    result: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}",
            "command": " ".join(["bench/sim_shape.py", *sys.argv[1:]]),
            "prompt_tokens": PROMPT_LEN,
            "rounds": ns.rounds,
            "repeat": ns.repeat,
            "ttft": "4-token streams of random-id prompts, sent `concurrent` at a time",
            "itl": f"{ITL_TOKENS}-token completions (ignore_eos, not streamed) after a "
            "16-token prompt, `batch` at once; the engine's ITL histogram mean",
        },
        "targets": {},
    }
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, str]] = {}  # target -> (url, model)
        if not ns.skip_sim:
            port = free_port()
            cmd = [sys.executable, "-m", "sim", "--profile", "cpu-tiny", "--model", "tiny",
                   "--port", str(port), "--max-num-seqs", MAX_NUM_SEQS, *ns.sim_arg]  # fmt: skip
            print(f"simulator: {' '.join(cmd[1:])}", flush=True)
            proc = stack.enter_context(started(cmd, logs / "sim-shape-sim.log"))
            urls["sim"] = (f"http://127.0.0.1:{port}", "tiny")
            await wait_up(urls["sim"][0], 30, proc)
            result["meta"]["sim_command"] = " ".join(["jetserve", *cmd[2:]])
        if ns.start_vllm or ns.vllm_url:
            url = ns.vllm_url
            if ns.start_vllm:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                cmd = [str(ROOT / "bench/peers/vllm.sh"), "serve", str(port),
                       "--max-num-seqs", MAX_NUM_SEQS]  # fmt: skip
                print(f"vLLM: {' '.join(cmd)}", flush=True)
                proc = stack.enter_context(started(cmd, logs / "sim-shape-vllm.log"))
                await wait_up(url, 300, proc)
                result["meta"]["vllm_command"] = " ".join(["bench/peers/vllm.sh", *cmd[1:]])
            async with httpx.AsyncClient(base_url=url) as c:
                result["meta"]["vllm_version"] = (await c.get("/version")).json().get("version")
            urls["vllm"] = (url, ns.vllm_model)
        # Taken in turn, `repeat` times each: the machine is shared, and load that comes
        # and goes then falls on both; each point is the median over the repeats.
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
        for k in range(ns.repeat):
            for name, (url, model) in urls.items():
                print(f"{name}, run {k + 1} of {ns.repeat}:", flush=True)
                runs[name].append(await measure(url, model, ns.rounds, ns.seed + k))
    result["targets"] = {name: combine(got) for name, got in runs.items()}
    return finish(result)


def finish(result: dict[str, Any]) -> int:
    result["shape"] = score(result)
    (OUT / "shape.json").write_text(json.dumps(result, indent=2) + "\n")
    drawn = plot(result, OUT / "shape.png")
    for name, claims in result["shape"].items():
        print(name, {k: (v["rises"], v["ratio"], v["spearman"]) for k, v in claims.items()})
    print("->", OUT / "shape.json", "(+ shape.png)" if drawn else "")
    return 0 if all(v["rises"] for c in result["shape"].values() for v in c.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start-vllm", action="store_true", help="start bench/peers/vllm.sh serve")
    p.add_argument("--vllm-url", default=None, help="a vLLM already serving")
    p.add_argument("--vllm-model", default="tiny")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--sim-arg", action="append", default=[], help="extra `jetserve sim` flag")
    p.add_argument("--rounds", type=int, default=6, help="requests per point and run")
    p.add_argument("--repeat", type=int, default=3, help="runs per target, taken in turn")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rescore", action="store_true", help="re-score and re-plot shape.json")
    ns = p.parse_args()
    if ns.rescore:
        return finish(json.loads((OUT / "shape.json").read_text()))
    return asyncio.run(main_async(ns))


if __name__ == "__main__":
    sys.exit(main())

"""Where each process's CPU goes under load: py-spy on the gateway and the
worker of a real fleet (fast simulator) while a closed loop of clients sends
16-token chat completions, summarised per process into
bench/results/profile/summary.md (inclusive and self shares of the samples).

    .venv/bin/pip install py-spy        # a profiler, not a project dependency
    .venv/bin/python bench/profile.py --seconds 12 --clients 16 [--stream]

The raw py-spy stacks go beside the summary (``<process>.txt.gz``, collapsed stacks:
``frame;frame;... count``), so a flame graph can be drawn from them later.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jetserve.fleet import Fleet, FleetSpec

OUT = Path("bench/results/profile")


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one row per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else name


Shares = list[tuple[float, str]]


def summarize(raw: Path, top: int = 50) -> tuple[int, Shares, Shares]:
    """(samples, inclusive shares, self shares) of one py-spy raw file."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [frame_name(f) for f in stack.split(";")]
        for name in set(frames):
            inclusive[name] += n
        own[frames[-1]] += n

    def share(c: collections.Counter[str]) -> Shares:
        return [(100.0 * v / max(total, 1), k) for k, v in c.most_common(top)]

    return total, share(inclusive), share(own)


def request_of(stream: bool, inputs: int) -> tuple[str, dict[str, object]]:
    """The path and body each client sends: a 16-token chat completion, or
    (``inputs`` > 0) an embeddings request of that many inputs."""
    if inputs:
        texts = [f"profile me, input {i} of {inputs}" for i in range(inputs)]
        return "/v1/embeddings", {"model": "sim-embed", "input": texts}
    return "/v1/chat/completions", {
        "model": "sim-8b",
        "messages": [{"role": "user", "content": "profile me"}],
        "max_tokens": 16,
        "stream": stream,
        "ignore_eos": True,
    }


async def load(
    url: str, key: str, clients: int, seconds: float, stream: bool, inputs: int = 0
) -> int:
    path, body = request_of(stream, inputs)
    done = 0
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as c:

        async def one_client() -> None:
            nonlocal done
            while time.monotonic() < end:
                r = await c.post(path, json=body)
                r.raise_for_status()
                done += 1

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--stream", action="store_true")
    p.add_argument(
        "--embeddings",
        type=int,
        default=0,
        metavar="INPUTS",
        help="send embeddings requests of this many inputs instead of chat",
    )
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        print("py-spy not found: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(FleetSpec(workers=1, profile="fast")).start()
    try:
        warm = load(fleet.base_url, fleet.api_key, args.clients, 2.0, args.stream, args.embeddings)
        asyncio.run(warm)
        procs = {"gateway": fleet.gateways[0].proc.pid, "worker": fleet.workers[0].proc.pid}
        record = [spy, "record", "-d", str(int(args.seconds)), "-r", "250", "-f", "raw"]
        spies = [
            subprocess.Popen(
                [*record, "-p", str(pid), "-o", str(args.out / f"{name}.txt")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, pid in procs.items()
        ]
        key = fleet.api_key
        done = asyncio.run(
            load(fleet.base_url, key, args.clients, args.seconds, args.stream, args.embeddings)
        )
        for s in spies:
            s.wait()
    finally:
        fleet.stop()
    kind = "streamed" if args.stream else "non-streamed"
    what = f"{kind} 16-token chat completions"
    if args.embeddings:
        what = f"embeddings requests of {args.embeddings} input(s)"
    lines = [
        "# Profile: where the CPU goes",
        "",
        f"py-spy, {args.seconds:g} s at 250 Hz, {args.clients} closed-loop clients sending "
        f"{what} through one gateway and one worker (fast "
        f"simulator); {done} requests in the window (the profiler slows what it samples). "
        f"Reproduce: `.venv/bin/python bench/profile.py --seconds {args.seconds:g} "
        f"--clients {args.clients}{' --stream' if args.stream else ''}"
        f"{f' --embeddings {args.embeddings}' if args.embeddings else ''}`.",
        "",
        "Shares are of the samples in which the process was running Python (idle "
        "excluded). Inclusive: the function or anything it called; self: the function's own code.",
    ]
    for name in procs:
        total, inc, own = summarize(args.out / f"{name}.txt")
        lines += ["", f"## {name} ({total} samples)", ""]
        lines += ["| inclusive | function |", "| ---: | --- |"]
        lines += [f"| {pct:.1f}% | `{fn}` |" for pct, fn in inc if pct < 99.5]
        lines += ["", "| self | function |", "| ---: | --- |"]
        lines += [f"| {pct:.1f}% | `{fn}` |" for pct, fn in own[:15]]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    for name in procs:  # the raw stacks, compressed (a megabyte a process)
        raw = args.out / f"{name}.txt"
        (args.out / f"{name}.txt.gz").write_bytes(gzip.compress(raw.read_bytes()))
        raw.unlink()
    print(args.out / "summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

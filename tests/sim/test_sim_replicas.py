"""``jetserve sim --replicas N``: N engines in one process, each on its own port with
its own KV cache, prefix cache, metrics and fault draws."""

from __future__ import annotations

import asyncio
import signal
import sys
from functools import partial

import httpx

from jetserve.services import free_ports
from sim.cli import build_parser, config_from_args
from sim.replicas import replica_configs
from tests.sim.processes import healthy
from tests.waits import until

LONG = " ".join(f"policy{i}" for i in range(400))  # ~400 prompt tokens: 25 full blocks


def _chat(content: str) -> dict[str, object]:
    return {"model": "sim-8b", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def test_replicas_serve_independent_engines_on_consecutive_ports() -> None:
    n = 3
    base = free_ports(n)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sim", "--port", str(base), "--replicas", str(n),
        "--profile", "fast", "--fault-seed", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{base + i}") for i in range(n)]
    try:
        for i, c in enumerate(clients):
            await until(partial(healthy, proc, c), f"replica {i} serving")
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "sim-8b"
        stats = [(await c.get("/sim/stats")).json() for c in clients]
        assert [s["fault_seed"] for s in stats] == [1, 2, 3]  # the fleet's --fault-seed n+1
        assert {s["seed"] for s in stats} == {0}  # one model: the same text everywhere

        # A prefix cached on replica 0 is a hit there and a miss on replica 1.
        first = await clients[0].post("/v1/chat/completions", json=_chat(LONG + " first"))
        again = await clients[0].post("/v1/chat/completions", json=_chat(LONG + " second"))
        other = await clients[1].post("/v1/chat/completions", json=_chat(LONG + " second"))
        assert first.status_code == again.status_code == other.status_code == 200
        hit = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert hit >= 384
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Same model, same seed: replica 1 answers replica 0's prompt with the same text.
        assert other.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]

        # Metrics and records are per replica.
        assert await _metric(clients[0], "vllm:prefix_cache_hits_total") == hit
        assert await _metric(clients[1], "vllm:prefix_cache_hits_total") == 0
        assert await _metric(clients[0], "vllm:request_success_total") == 2
        assert await _metric(clients[1], "vllm:request_success_total") == 1
        assert await _metric(clients[2], "vllm:request_success_total") == 0
        after = [(await c.get("/sim/stats")).json() for c in clients]
        assert [s["finished"] for s in after] == [2, 1, 0]
        assert after[0]["kv_blocks_cached"] > 0
        assert after[2]["kv_blocks_cached"] == 0

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
        assert proc.stdout is not None
        assert f"ports {base}..{base + n - 1}" in (await proc.stdout.read()).decode()
    finally:
        for c in clients:
            await c.aclose()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_replica_seeds() -> None:
    # --replicas 3 --fault-seed 1: the seeds of three simulators with --fault-seed 1, 2, 3.
    ns = build_parser().parse_args(["--replicas", "3", "--fault-seed", "1", "--seed", "9"])
    cfgs = replica_configs(config_from_args(ns), ns.replicas)
    assert [(c.seed, c.fault_seed) for c in cfgs] == [(9, 1), (9, 2), (9, 3)]
    # Without --fault-seed, replica i draws from --seed + i; one replica keeps its config.
    plain = config_from_args(build_parser().parse_args(["--seed", "4"]))
    assert [c.fault_seed for c in replica_configs(plain, 2)] == [4, 5]
    assert replica_configs(plain, 1) == [plain]


def test_bad_replica_count_is_refused() -> None:
    from sim.cli import main

    assert main(["--replicas", "0"]) == 2

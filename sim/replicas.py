"""``jetserve sim --replicas N``: N independent engines in one process and one loop.

Each replica is a whole simulator (its own engine, KV cache, prefix cache, metrics
registry, request records, fault draws) on its own port, PORT..PORT+N-1; only the
process and the event loop are shared, which is what lets a fleet bench put many
engines on a small machine (an idle engine's loop task does not exist).

Seeds follow the fleet's convention for replicas of one model (jetserve/fleet.py
starts engine-per-worker simulators with ``--fault-seed n+1``): every replica shares
``--seed`` (the same text for the same prompt, as replicas of one model give) and
draws faults from its own seed, ``(--fault-seed, else --seed) + i``; so
``--replicas N --fault-seed 1`` draws what N separate ``--fault-seed 1..N`` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Generator

import msgspec
import uvicorn

from sim.config import SimConfig
from sim.kv_events import offset_endpoint


def replica_configs(cfg: SimConfig, n: int) -> list[SimConfig]:
    """Replica i's config: `cfg` with its own fault seed (i = 0 keeps `cfg`'s)
    and its own KV events endpoint (port + i, vLLM's rule for its DP ranks)."""
    base = cfg.seed if cfg.fault_seed is None else cfg.fault_seed
    if n == 1:
        return [cfg]
    ep = cfg.kv_events_endpoint
    return [
        msgspec.structs.replace(
            cfg, fault_seed=base + i, kv_events_endpoint=offset_endpoint(ep, i) if ep else None
        )
        for i in range(n)
    ]


class _ReplicaServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # serve_replicas owns the signals, for every replica at once


def serve_replicas(configs: list[uvicorn.Config]) -> int:
    """Serve every config's app until SIGINT/SIGTERM; 0 if all of them started."""
    servers = [_ReplicaServer(c) for c in configs]

    async def run() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            for s in servers:
                s.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        try:
            await asyncio.gather(*(s.serve() for s in servers))
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=configs[0].get_loop_factory()) as runner:
        runner.run(run())
    return 0 if all(s.started for s in servers) else 1

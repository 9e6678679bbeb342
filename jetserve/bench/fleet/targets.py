"""`--fleet`: start a whole jetserve fleet (and LiteLLM, when installed) and measure
it against its own engine. Targets: `direct` (the simulator), `jetserve` (the
gateway) and `litellm` (LiteLLM's proxy in front of the same simulator)."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

from jetserve.bench.peer_litellm import (
    LiteLLMPeer,
    find_litellm,
    install_litellm,
    litellm_version,
)
from jetserve.bench.targets import Target
from jetserve.fleet import Fleet, FleetSpec

PeerMode = Literal["auto", "yes", "install", "no"]


class FleetOptions(msgspec.Struct, frozen=True, kw_only=True):
    profile: str = "h100-8b"
    workers: int = 2
    gateways: int = 1
    share_port: bool = False  # the gateways bind one port (SO_REUSEPORT)
    model: str = "sim-8b"
    # A real OpenAI-compatible engine already running (a vLLM): it replaces the
    # simulator behind every target, and its CPU is not counted.
    engine_url: str | None = None
    litellm: PeerMode = "auto"  # auto: when installed; install: install first if missing
    sim_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()


class LocalTargets(msgspec.Struct, kw_only=True):
    targets: list[Target]
    engine_metrics: str  # the simulator's /metrics: the sweep waits for it to go idle
    meta: dict[str, object]
    processes: dict[str, list[int]] = msgspec.field(default_factory=dict)  # CPU accounting


def _say(text: str) -> None:
    print(f"jetserve bench: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def local_fleet(opts: FleetOptions) -> Iterator[LocalTargets]:
    spec = FleetSpec(
        workers=opts.workers,
        gateways=opts.gateways,
        gateways_share_port=opts.share_port,
        engine_url=opts.engine_url,
        profile=opts.profile,
        model=opts.model,
        sim_args=list(opts.sim_args),
        worker_args=list(opts.worker_args),
        gateway_args=list(opts.gateway_args),
    )
    engine_text = opts.engine_url or f"simulator ({opts.profile})"
    _say(f"starting a fleet: {engine_text}, {opts.workers} workers ...")
    fleet = Fleet(spec).start()
    engine = (opts.engine_url or fleet.sim_url).rstrip("/")
    peer: LiteLLMPeer | None = None
    try:
        targets = [
            Target(name="direct", url=f"{engine}/v1"),
            Target(name="jetserve", url=f"{fleet.base_url}/v1", key=fleet.api_key),
        ]
        meta: dict[str, object] = {
            "mode": "fleet",
            "profile": opts.profile if opts.engine_url is None else None,
            "engine": "simulator" if opts.engine_url is None else opts.engine_url,
            "workers": opts.workers,
            "gateways": opts.gateways,
            "gateways_share_port": opts.share_port,
            "engine_replicas": 1,  # one simulator behind every target
            "litellm": "not used",
            # Which processes serve each target, beyond the engine they share.
            "cpu_path": {
                "direct": [],
                "jetserve": ["gateway", "workers", "nats", "redis"],
                "litellm": ["litellm"],
            },
        }
        exe = find_litellm()
        if exe is None and opts.litellm == "install":
            _say("installing LiteLLM's proxy into its own venv (bench/peers/litellm.sh) ...")
            exe = install_litellm()
        if exe is None and opts.litellm == "yes":
            raise SystemExit("LiteLLM is not installed: bench/peers/litellm.sh install")
        if exe is not None and opts.litellm != "no":
            workdir = Path(tempfile.mkdtemp(prefix="jetserve-bench-litellm-"))
            peer = LiteLLMPeer(exe, workdir, model=opts.model, api_base=f"{engine}/v1")
            _say("starting LiteLLM's proxy ...")
            targets.append(peer.start())
            meta["litellm"] = {
                "version": litellm_version(exe),
                "provider": "hosted_vllm/",
                "workers": 1,
            }
        elif opts.litellm == "auto":
            _say("LiteLLM not installed: skipping it (bench/peers/litellm.sh install)")
        processes = {
            "engine": [fleet.sim.proc.pid] if fleet.sim else [],
            "gateway": [g.proc.pid for g in fleet.gateways],
            "workers": [w.proc.pid for w in fleet.workers],
            "nats": [fleet.nats.proc.pid] if fleet.nats else [],
            "redis": [fleet.redis.proc.pid] if fleet.redis else [],
            "litellm": [peer.proc.pid] if peer is not None and peer.proc is not None else [],
        }
        yield LocalTargets(
            targets=targets,
            engine_metrics=f"{engine}/metrics",
            meta=meta,
            processes=processes,
        )
    finally:
        if peer is not None:
            peer.stop()
        fleet.stop()

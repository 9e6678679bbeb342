"""`jetserve sim ...` / `python -m sim ...`: serve the simulator over HTTP."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Generator

import msgspec
import uvicorn
from starlette.applications import Starlette

from sim.app import create_app
from sim.config import SimConfig
from sim.profiles import PROFILES
from sim.replicas import replica_configs, serve_replicas

_DROP_LOG = "ASGI callable returned without completing response."


class _SimulatedDropFilter(logging.Filter):
    """The drop:N fault closes sockets on purpose; uvicorn would log each as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _DROP_LOG


def quiet_simulated_drops() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _SimulatedDropFilter) for f in logger.filters):
        logger.addFilter(_SimulatedDropFilter())


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the signal after a graceful shutdown (the process then dies
        # of SIGTERM, or raises KeyboardInterrupt); main() returns 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def uvicorn_config(app: Starlette, host: str, port: int) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,  # streams that would never end (stall) must not block exit
    )
    quiet_simulated_drops()  # after Config: it (re)configures uvicorn's loggers
    return config


def _fault_rate(text: str) -> tuple[str, float]:
    spec, sep, rate = text.rpartition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected FAULT=RATE, e.g. 429=0.05: {text!r}")
    try:
        return spec, float(rate)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate must be a number: {text!r}") from None


class KvEventsConfig(msgspec.Struct, frozen=True):
    """vLLM's ``--kv-events-config`` (the fields the simulator honours)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""


def _kv_events_config(text: str) -> KvEventsConfig:
    try:
        cfg = msgspec.json.decode(text, type=KvEventsConfig)
    except msgspec.DecodeError as e:
        raise argparse.ArgumentTypeError(f"--kv-events-config: {e}") from None
    if cfg.enable_kv_cache_events and cfg.publisher != "zmq":
        raise argparse.ArgumentTypeError("--kv-events-config: only the zmq publisher is simulated")
    return cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetserve sim", description="vLLM-compatible engine simulator (OpenAI API)."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--profile", default="h100-8b", choices=sorted(PROFILES))
    p.add_argument("--model", default="sim-8b", help="served model name")
    p.add_argument(
        "--alias", action="append", default=None, help="another served name (repeatable)"
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME",
        help="a LoRA adapter served on top of --model (repeatable): listed in /v1/models "
        "with parent = the model; its text differs from the base's, deterministically",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-seed", type=int, default=None, help="fault draws (default: --seed)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="a step's token budget, decodes and prefill chunks (default: the profile's)",
    )
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--embedding-dim", type=int, default=384)
    p.add_argument(
        "--embedding-encodings",
        default="float,base64",
        help="encoding_format values /v1/embeddings takes (float: as an engine without base64)",
    )
    p.add_argument(
        "--engine-version",
        default="0.0.0+jetserve.sim",
        help="the version /version and /info report (a new engine build, to the workers)",
    )
    p.add_argument(
        "--fault-rate",
        type=_fault_rate,
        action="append",
        default=[],
        metavar="FAULT=RATE",
        help="e.g. 429=0.05, drop:3=0.01, slow:80=0.1 (repeatable)",
    )
    p.add_argument("--scripts", default=None, metavar="FILE", help="scripted response rules")
    p.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="vLLM's KV cache events, e.g. '{\"enable_kv_cache_events\":true,"
        '"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}\''
        "; replica i publishes on port + i",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="N independent engines in this process, on ports PORT..PORT+N-1; replica i "
        "draws faults from (--fault-seed, else --seed) + i",
    )
    return p


def config_from_args(ns: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=ns.model,
        aliases=tuple(ns.alias) if ns.alias is not None else ("sim-embed",),
        loras=tuple(ns.lora),
        profile=ns.profile,
        seed=ns.seed,
        fault_seed=ns.fault_seed,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        num_gpu_blocks=ns.num_gpu_blocks,
        block_size=ns.block_size,
        max_model_len=ns.max_model_len,
        embedding_dim=ns.embedding_dim,
        embedding_encodings=tuple(e for e in ns.embedding_encodings.split(",") if e),
        engine_version=ns.engine_version,
        fault_rates=dict(ns.fault_rate),
        scripts_path=ns.scripts,
        **_kv_events_fields(ns.kv_events_config),
    )


def _kv_events_fields(cfg: KvEventsConfig | None) -> dict[str, str]:
    if cfg is None or not cfg.enable_kv_cache_events:
        return {}
    return {"kv_events_endpoint": cfg.endpoint, "kv_events_topic": cfg.topic}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = config_from_args(ns)
        if ns.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {ns.replicas}")
        apps = [create_app(c) for c in replica_configs(cfg, ns.replicas)]
    except (ValueError, OSError) as e:
        print(f"jetserve sim: {e}", file=sys.stderr)
        return 2
    if len(apps) > 1:
        ports = [ns.port + i for i in range(len(apps))]
        print(f"jetserve sim: {len(apps)} replicas on {ns.host} ports {ports[0]}..{ports[-1]}")
        return serve_replicas(
            [uvicorn_config(app, ns.host, port) for app, port in zip(apps, ports, strict=True)]
        )
    server = _Server(uvicorn_config(apps[0], ns.host, ns.port))
    server.run()  # returns on SIGINT/SIGTERM
    return 0 if server.started else 1

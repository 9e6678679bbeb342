"""A whole jetserve fleet as real processes on loopback: nats-server,
redis-server, the engine simulator, a gateway and N workers.

``jetserve up`` runs one for people; the connected test tier runs them for
tests (killing and restarting members to prove the failure rules).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import msgspec
from nats.aio.client import Client

from jetserve.commands.admin_client import AdminClient
from jetserve.credentials import Credentials, generate
from jetserve.fleet_probes import pulling, run_sync, wait_jetstream
from jetserve.services import (
    NATS_SYNC_DEFAULT,
    REDIS_APPENDFSYNC_DEFAULT,
    Service,
    ServiceError,
    free_port,
    free_ports,
    start_nats,
    start_nats_cluster,
    start_redis,
    start_redis_cluster,
    wait_port,
)
from streams.agent_topology import DEFAULT_AGENT
from streams.auth import Role
from streams.connect import OPEN, BusAuth, connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import RequestClass


@dataclass
class FleetSpec:
    workers: int = 2
    gateway_port: int = 0
    gateways: int = 1  # several replicas share NATS and Redis (the multi-gateway tests)
    # The gateways bind one public port with SO_REUSEPORT (scale up on one node).
    gateways_share_port: bool = False
    nats_nodes: int = 1  # 3: a JetStream cluster, every stream R3
    export_spans: bool = False  # OpenTelemetry spans to <workdir>/<process>.spans.jsonl
    profile: str = "fast"
    api_key: str | None = None
    tenant: str = "demo"
    model: str = "sim-8b"
    engine_url: str | None = None  # an engine already running (a real vLLM): no simulator
    sim_args: list[str] = field(default_factory=list)
    # Each worker with its own simulator: a replica (engine + worker), as a GPU
    # fleet has, so prefix caches are per replica.
    engine_per_worker: bool = False
    # A fleet of many replicas on one machine (issue 16): ``sim_replicas``
    # engines served by simulator processes of ``replicas_per_sim`` each
    # (``jetserve sim --replicas``), driven by worker processes of
    # ``engines_per_worker`` engines each (``jetserve worker --engine ... --engine``).
    sim_replicas: int = 0
    replicas_per_sim: int = 32
    engines_per_worker: int = 1
    # Prefix-affinity lanes per lane class. A production gateway's default is
    # 256 (docs/routing.md); a fleet on one machine needs far fewer, and each
    # file-backed lane consumer costs nats-server ~10 ms to stop (512: 5 s).
    lanes: int = 32
    # One work-queue stream per class (gateway --class-streams; docs/scale.md).
    class_streams: bool = False
    lane_shards: int = 1  # gateway --lane-shards (with class_streams)
    # Capture streams of the reply frames (gateway --frames-partitions, docs/scale.md).
    frames_partitions: int = 1
    # Engines publish vLLM's KV cache events (sim --kv-events-config) and their
    # workers follow them (worker --kv-events): the fleet's KV index is fed; a
    # gateway routes by it with ``--kv-index`` in ``gateway_args``.
    kv_events: bool = False
    # Worker ids' suffix (default: the start time). Fixed, two fleets draw the
    # same lane ownership for the same members (benches comparing arms).
    worker_id_suffix: str = ""
    worker_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    agents: int = 0  # agent run executors (`jetserve agent --demo-tools`)
    agent_args: list[str] = field(default_factory=list)
    # The simulator's fault hooks (X-Sim-*) pass through: demos and tests only.
    forward_header_prefix: str = "x-sim-"
    log_level: str = "warning"
    # Tenants that get a service credential for the NATS-native API (the fleet's
    # own tenant always does). insecure: an open bus, no credentials at all.
    service_tenants: tuple[str, ...] = ()
    insecure: bool = False
    # Durability (docs/reliability.md#durability-settings): JetStream's fsync
    # policy (always, or a duration) and Redis's appendfsync, as deploy/ runs them.
    nats_sync: str = NATS_SYNC_DEFAULT
    redis_appendfsync: str = REDIS_APPENDFSYNC_DEFAULT
    # Above 1: a Redis Cluster of that many primaries (at least 3); the gateways
    # and agents run with --redis-cluster, seeded from the first node.
    redis_nodes: int = 1


def kv_events_args(port: int) -> list[str]:
    """A simulator's flags to publish vLLM's KV events on ``port`` (replica i of
    ``--replicas``: port + i)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": "kv-events",
    }
    return ["--kv-events-config", msgspec.json.encode(config).decode()]


@dataclass
class Proc:
    name: str
    args: list[str]
    proc: subprocess.Popen[bytes]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone (no graceful anything)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Stoppable(Protocol):
    proc: subprocess.Popen[bytes]


def stop_together(procs: Sequence[_Stoppable], timeout: float) -> None:
    """SIGTERM every live one, then wait for all (SIGKILL past ``timeout``)."""
    live = [p for p in procs if p.proc.poll() is None]
    for p in live:
        p.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for p in live:
        try:
            p.proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


class Fleet:
    def __init__(self, spec: FleetSpec | None = None) -> None:
        self.spec = spec or FleetSpec()
        self.workdir = Path(tempfile.mkdtemp(prefix="jetserve-fleet-"))
        self.stopped_violations: list[str] | None = None
        self.nats: Service | None = None
        self.nats_nodes: list[Service] = []  # all nodes (one unless a cluster)
        self.redis: Service | None = None  # the first (or only) node
        self.redis_nodes: list[Service] = []
        self.sim: Proc | None = None
        self.worker_sims: list[Proc | None] = []  # engine_per_worker: each worker's own
        self.extra_sims: list[Proc] = []  # engines started apart (start_engine)
        self.replica_urls: list[str] = []  # sim_replicas: every engine's base URL
        self.kv_endpoints: dict[str, str] = {}  # kv_events: engine URL -> its events endpoint
        self._engine_ports: list[int] = []  # start_engine's
        self.worker_sim_ports: list[int] = []
        self.gateways: list[Proc] = []
        self.gateway_ports: list[int] = []
        self.worker_metrics_ports: list[int] = []
        self.admin_ports: list[int] = []
        # /metrics has its own listener per gateway (never the public port).
        self.gateway_metrics_ports: list[int] = []
        self.gateway_metrics_urls: list[str] = []
        self.admin_token = secrets.token_urlsafe(24)
        # Every gateway of the fleet hashes API keys under this one secret.
        self.key_secret = secrets.token_urlsafe(32)
        # Gateways get their secrets as files (0600, in the 0700 workdir), named
        # in the environment: never in a command line, which `ps` shows to
        # everyone. The plain variables are set empty so that ones inherited
        # from the caller's environment (which read_secret prefers) cannot win.
        self.secret_env: dict[str, str] = {}
        for name, value in (
            ("JETSERVE_ADMIN_TOKEN", self.admin_token),
            ("JETSERVE_KEY_SECRET", self.key_secret),
        ):
            path = self.workdir / f"{name.lower()}.secret"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(value)
            self.secret_env |= {name: "", f"{name}_FILE": str(path)}
        self.workers: list[Proc] = []
        self.agents: list[Proc] = []
        self.sim_port = 0
        self.api_key = ""
        self.key_id = ""
        self.creds: Credentials | None = None

    # -- addresses ---------------------------------------------------------
    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return ",".join(f"nats://127.0.0.1:{n.port}" for n in self.nats_nodes)

    @property
    def redis_url(self) -> str:
        """Redis as its admin user, password included: for this process (tests,
        demos), never for a child's command line."""
        assert self.redis is not None
        if self.creds is None:
            return f"redis://127.0.0.1:{self.redis.port}/0"
        return f"redis://admin:{self.creds.redis_password('admin')}@127.0.0.1:{self.redis.port}/0"

    @property
    def _redis_flags(self) -> list[str]:
        return ["--redis-cluster"] if self.spec.redis_nodes > 1 else []

    def redis_url_of(self, user: str) -> str:
        """Redis as one ACL user, without its password (that travels in the env)."""
        assert self.redis is not None
        who = f"{user}@" if self.creds is not None else ""
        return f"redis://{who}127.0.0.1:{self.redis.port}/0"

    def bus_auth(self, role: Role = Role.ADMIN, tenant: str | None = None) -> BusAuth:
        """A role's NATS credential, for connections from this process."""
        return OPEN if self.creds is None else self.creds.bus_auth(role, tenant)

    async def connect(
        self, role: Role = Role.ADMIN, tenant: str | None = None, name: str = "fleet-client"
    ) -> Client:
        """A NATS connection as ``role`` (a service: of ``tenant``)."""
        return await connect(self.nats_url, name, self.bus_auth(role, tenant))

    def _env(self, role: Role, redis_user: str | None = None) -> dict[str, str]:
        """A child's credentials, as files named in its environment."""
        if self.creds is None:
            return {}
        env = self.creds.nats_env(role)
        if redis_user is not None:
            env.update(self.creds.redis_env(redis_user))
        return env

    @property
    def _bus_flags(self) -> list[str]:
        return ["--insecure"] if self.creds is None else []

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    @property
    def gateway(self) -> Proc | None:
        return self.gateways[0] if self.gateways else None

    @property
    def gateway_port(self) -> int:
        return self.gateway_ports[0]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def base_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    @property
    def admin_url(self) -> str:
        """The admin API of the first gateway still running (tests kill replicas)."""
        for gw, port in zip(self.gateways, self.admin_ports, strict=True):
            if gw.proc.poll() is None:
                return f"http://127.0.0.1:{port}"
        return f"http://127.0.0.1:{self.admin_ports[0]}"

    def admin(self) -> AdminClient:
        return AdminClient(self.admin_url, self.admin_token)

    def _context_args(self) -> list[str]:
        """The simulator's max_model_len, told to the gateway, which refuses what
        cannot fit (a real engine's is for whoever runs it to set, or its route's)."""
        if self.spec.engine_url is not None:
            return []
        n: int | None = None
        args = self.spec.sim_args
        for i, arg in enumerate(args):
            if arg == "--max-model-len" and i + 1 < len(args):
                n = int(args[i + 1])
            elif arg.startswith("--max-model-len="):
                n = int(arg.partition("=")[2])
        if n is None:
            from sim.profiles import PROFILES

            profile = PROFILES.get(self.spec.profile)
            n = profile.max_model_len if profile else None
        return ["--context-length", f"{self.spec.model}={n}"] if n else []

    def log_tails(self, lines: int) -> list[tuple[str, str]]:
        """(process name, its log's last ``lines`` lines), for every process log."""
        out = []
        for log in sorted(self.workdir.glob("*.log")):
            with log.open("rb") as fh:
                fh.seek(max(0, log.stat().st_size - 200 * lines))
                text = fh.read().decode(errors="replace")
            out.append((log.stem, "\n".join(text.splitlines()[-lines:])))
        return out

    # -- lifecycle ---------------------------------------------------------
    def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        cmd = [sys.executable, "-m", "jetserve", "--log-level", self.spec.log_level, *args]
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        finally:
            log.close()
        return Proc(name, cmd, proc)

    def start(self) -> Fleet:
        try:
            if not self.spec.insecure:
                tenants = tuple(dict.fromkeys((self.spec.tenant, *self.spec.service_tenants)))
                self.creds = generate(self.workdir / "creds", tenants)
            conf = self.creds.nats_conf if self.creds is not None else None
            acl = self.creds.redis_acl if self.creds is not None else None
            if self.spec.nats_nodes > 1:
                self.nats_nodes = start_nats_cluster(
                    self.workdir / "nats", self.spec.nats_nodes, conf, self.spec.nats_sync
                )
                self.nats = self.nats_nodes[0]
                run_sync(wait_jetstream(self.nats_url, 30.0, self.bus_auth()))
            else:
                self.nats_nodes = [
                    start_nats(self.workdir / "nats", auth_conf=conf, sync=self.spec.nats_sync)
                ]
                self.nats = self.nats_nodes[0]
            if self.spec.redis_nodes > 1:
                self.redis_nodes = start_redis_cluster(
                    self.workdir / "redis",
                    self.spec.redis_nodes,
                    self.creds,
                    self.spec.redis_appendfsync,
                )
            else:
                self.redis_nodes = [
                    start_redis(
                        self.workdir / "redis", acl=acl, appendfsync=self.spec.redis_appendfsync
                    )
                ]
            self.redis = self.redis_nodes[0]
            # Side by side: the engine and the gateways, then (the engine up) the
            # workers and executors, which wait for the topology a gateway
            # provisions. Ports never repeat within a process (services.py), so
            # none goes to two children that have not bound theirs yet.
            if self.spec.sim_replicas:
                self.start_replica_sims()
            elif self.spec.engine_url is None and not self.spec.engine_per_worker:
                self.start_sim(wait=False)
            for _ in range(self.spec.gateways):
                self.start_gateway(wait=False)
            if self.sim is not None:
                wait_port(self.sim_port, 20.0, self.sim.proc)
            if not self.spec.sim_replicas:
                for _ in range(self.spec.workers):
                    self.start_worker(wait=False)
            for _ in range(self.spec.agents):
                self.start_agent(wait=False)
            for n in range(len(self.gateways)):
                self.wait_gateway(n)
            with self.admin() as admin:
                admin.create_tenant(self.spec.tenant)
                created = admin.create_key(self.spec.tenant, "fleet", api_key=self.spec.api_key)
            self.api_key, self.key_id = created["api_key"], created["key"]["key_id"]
            if self.spec.sim_replicas:
                per = self.spec.engines_per_worker
                urls = self.replica_urls
                for n in range(0, len(urls), per):
                    more = [arg for url in urls[n + 1 : n + per] for arg in ("--engine", url)]
                    self.start_worker(*more, wait=False, engine=urls[n])
                # Dozens of engines behind a few processes start slower on a
                # busy machine: half a second more per replica.
                self.wait_workers(len(urls), timeout=30.0 + len(urls) / 2)
            else:
                self.wait_workers(self.spec.workers)
            if self.spec.agents:
                self.wait_agents(self.spec.agents)
        except BaseException:
            self.stop()
            raise
        return self

    def start_replica_sims(self) -> None:
        """``sim_replicas`` engines, ``replicas_per_sim`` to a process, each
        replica with its own fault seed and the fleet's text seed."""
        left, n = self.spec.sim_replicas, 0
        while left:
            k = min(left, self.spec.replicas_per_sim)
            # With KV events, k more ports right after (free_ports twice before
            # anything binds could hand out the same range twice).
            base = free_ports(2 * k if self.spec.kv_events else k)
            args = ["--replicas", str(k), "--fault-seed", str(1 + len(self.replica_urls))]
            kv_base = base + k if self.spec.kv_events else 0
            if kv_base:
                args += kv_events_args(kv_base)  # replica i: kv_base + i
            self.extra_sims.append(self._spawn_sim(f"sims{n}", base, args, wait=False))
            for i, port in enumerate(range(base, base + k)):
                wait_port(port, 60.0, self.extra_sims[-1].proc)
                self.replica_urls.append(f"http://127.0.0.1:{port}")
                if kv_base:
                    self.kv_endpoints[self.replica_urls[-1]] = f"tcp://127.0.0.1:{kv_base + i}"
            left, n = left - k, n + 1

    def start_sim(self, wait: bool = True) -> None:
        self.sim_port = self.sim_port or free_port()
        self.sim = self._spawn_sim("sim", self.sim_port, wait=wait)

    def _spawn_sim(
        self, name: str, port: int, extra: Sequence[str] = (), wait: bool = True
    ) -> Proc:
        sim = self._spawn(
            name,
            "sim",
            "--port",
            str(port),
            "--profile",
            self.spec.profile,
            "--model",
            self.spec.model,
            *self.spec.sim_args,
            *extra,
        )
        if wait:
            try:
                wait_port(port, 20.0, sim.proc)
            except BaseException:
                sim.kill()  # not held by the fleet yet: its stop() would leave it running
                raise
        return sim

    def start_engine(self, *sim_args: str) -> str:
        """One more simulator of the fleet's profile and model; its base URL."""
        port = free_port()
        n = len(self.extra_sims)
        kv_port = free_port() if self.spec.kv_events else 0
        kv = kv_events_args(kv_port) if kv_port else []
        self.extra_sims.append(self._spawn_sim(f"engine{n}", port, [*kv, *sim_args]))
        self._engine_ports.append(port)
        url = f"http://127.0.0.1:{port}"
        if kv_port:
            self.kv_endpoints[url] = f"tcp://127.0.0.1:{kv_port}"
        return url

    def extra_ports(self) -> list[int]:
        """The ports of the engines started with :meth:`start_engine`."""
        return list(self._engine_ports)

    def start_gateway(self, *extra: str, wait: bool = True) -> Proc:
        """One more gateway replica; ``extra``: flags after the fleet's (later ones win)."""
        n = len(self.gateways)
        shared = self.spec.gateways_share_port
        if shared and n > 0:
            port = self.gateway_ports[0]
        else:
            port = (self.spec.gateway_port if n == 0 else 0) or free_port()
        admin_port = free_port()
        metrics_port = free_port()
        gw = self._spawn(
            f"gateway{n}",
            "gateway",
            "--nats",
            self.nats_url,
            "--redis",
            self.redis_url_of("gateway"),
            *self._redis_flags,
            "--port",
            str(port),
            *(["--reuse-port"] if shared else []),
            "--admin-port",
            str(admin_port),
            "--metrics-port",
            str(metrics_port),
            "--models",
            self.spec.model,
            # The simulator serves its embedding model too; a real engine, only its own.
            *(["--embedding-models", "sim-embed"] if self.spec.engine_url is None else []),
            "--forward-header-prefix",
            self.spec.forward_header_prefix,
            *self._context_args(),
            "--lanes",
            str(self.spec.lanes),
            # Only when set: a baseline checkout's gateway may not know them.
            *(["--class-streams"] if self.spec.class_streams else []),
            *(["--lane-shards", str(self.spec.lane_shards)] if self.spec.lane_shards > 1 else []),
            *(
                ["--frames-partitions", str(self.spec.frames_partitions)]
                if self.spec.frames_partitions > 1
                else []
            ),
            *self._replica_args,
            *self._span_args(f"gateway{n}"),
            *self._bus_flags,
            *self.spec.gateway_args,
            *extra,
            env={**self.secret_env, **self._env(Role.GATEWAY, "gateway")},
        )
        self.gateways.append(gw)
        self.gateway_ports.append(port)
        self.admin_ports.append(admin_port)
        self.gateway_metrics_ports.append(metrics_port)
        self.gateway_metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
        if wait:
            self.wait_gateway(len(self.gateways) - 1)
        return gw

    def wait_gateway(self, n: int) -> None:
        """Until gateway ``n`` is ready and serves its metrics."""
        gw = self.gateways[n]
        if self.spec.gateways_share_port:
            # The shared port may answer from another process: this one is ready
            # once its own metrics listener serves (its runtime is open by then).
            self._wait_ready(gw, self.gateway_metrics_ports[n], path="/metrics")
        else:
            self._wait_ready(gw, self.gateway_ports[n])
        wait_port(self.gateway_metrics_ports[n], 10.0, gw.proc)  # its own listener

    def _wait_ready(
        self, gw: Proc, port: int, timeout: float = 30.0, path: str = "/readyz"
    ) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if gw.proc.poll() is not None:
                raise ServiceError(f"gateway exited ({gw.proc.returncode}); see {self.workdir}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise ServiceError(f"gateway not ready after {timeout}s; see {self.workdir}")

    def start_worker(
        self,
        *extra: str,
        wait: bool = True,
        sim_args: Sequence[str] = (),
        engine: str | None = None,
    ) -> Proc:
        """A worker (and with ``engine_per_worker`` its own simulator, given
        ``sim_args`` on top of the fleet's); ``engine``: its (first) engine."""
        n = len(self.workers)
        metrics_port = free_port()
        self.worker_metrics_ports.append(metrics_port)
        engine = engine or self.spec.engine_url or self.sim_url
        sim: Proc | None = None
        if self.spec.engine_per_worker:
            port = free_port()
            # Replicas of one model: the same text, but independent fault draws.
            kv_port = free_port() if self.spec.kv_events else 0
            kv = kv_events_args(kv_port) if kv_port else []
            sim = self._spawn_sim(f"sim{n}", port, ["--fault-seed", str(n + 1), *kv, *sim_args])
            engine = f"http://127.0.0.1:{port}"
            if kv_port:
                self.kv_endpoints[engine] = f"tcp://127.0.0.1:{kv_port}"
            self.worker_sim_ports.append(port)
        self.worker_sims.append(sim)
        # Each engine's KV events, in the order of its --engine.
        engines = [engine, *(a for i, a in enumerate(extra) if i and extra[i - 1] == "--engine")]
        kv_flags = [
            arg for url in engines if url in self.kv_endpoints
            for arg in ("--kv-events", self.kv_endpoints[url])
        ]  # fmt: skip
        worker = self._spawn(
            f"worker{n}",
            "worker",
            "--nats",
            self.nats_url,
            "--engine",
            engine,
            "--worker-id",
            f"worker{n}-{self.spec.worker_id_suffix or int(time.time() * 1000) % 100000}",
            "--metrics-port",
            str(metrics_port),
            *self._replica_args,
            *self._span_args(f"worker{n}"),
            *self._bus_flags,
            *self.spec.worker_args,
            *extra,
            *kv_flags,
            env=self._env(Role.WORKER),
        )
        self.workers.append(worker)
        if wait:
            self.wait_workers(sum(1 for w in self.workers if w.proc.poll() is None))
        return worker

    def start_agent(self, *extra: str, wait: bool = True) -> Proc:
        """An agent run executor with the demo tools (their bank is this fleet's Redis)."""
        n = len(self.agents)
        agent = self._spawn(
            f"agent{n}",
            "agent",
            "--nats",
            self.nats_url,
            "--redis",
            self.redis_url_of("agent"),
            *self._redis_flags,
            "--demo-tools",
            "--executor-id",
            f"agent{n}-{int(time.time() * 1000) % 100000}",
            *self._replica_args,
            *self._bus_flags,
            *self.spec.agent_args,
            *extra,
            env=self._env(Role.AGENT, "agent"),
        )
        self.agents.append(agent)
        if wait:
            self.wait_agents(sum(1 for a in self.agents if a.proc.poll() is None))
        return agent

    def wait_agents(self, n: int, timeout: float = 30.0) -> None:
        """Until n pull requests wait on the step consumer: executors are live."""
        agent = DEFAULT_AGENT
        probe = pulling(
            self.nats_url, agent.stream, agent.step_consumer, n, timeout, self.bus_auth()
        )
        if not run_sync(probe):
            raise ServiceError(f"{n} executors not pulling after {timeout}s; see {self.workdir}")

    def wait_workers(self, n: int, timeout: float = 30.0) -> None:
        """Until n pull requests wait on the interactive consumer: workers are live."""
        topo = DEFAULT_TOPOLOGY.split(self.spec.class_streams, self.spec.lane_shards)
        consumer = topo.consumer_name(RequestClass.INTERACTIVE)
        stream = topo.stream_of(RequestClass.INTERACTIVE)
        probe = pulling(self.nats_url, stream, consumer, n, timeout, self.bus_auth())
        if not run_sync(probe):
            raise ServiceError(f"{n} workers not pulling after {timeout}s; see {self.workdir}")

    def _span_args(self, name: str) -> list[str]:
        if not self.spec.export_spans:
            return []
        return ["--otel-exporter", f"file://{self.workdir / name}.spans.jsonl"]

    @property
    def _replica_args(self) -> list[str]:
        return ["--replicas", "3"] if self.spec.nats_nodes >= 3 else []

    def violations(self) -> list[str]:
        """Every permission violation the bus logged: a role that tried what its
        credential does not allow (a missing grant, or an attack)."""
        if self.stopped_violations is not None:  # read before the directory went
            return self.stopped_violations
        return [line for node in self.nats_nodes for line in node.violations()]

    def stop(self, keep: bool = False) -> None:
        """Stop every process, then remove the fleet's directory: its stores'
        data, logs and credentials (secrets among them) go with it, unless
        ``keep`` (a failed test, a `jetserve up` whose process died: the logs
        are for a look) or ``JETSERVE_KEEP_FLEETS`` is set."""
        # Executors and workers first (they drain), then the gateways and the
        # engines, then the stores and the bus; each tier at once (every one of
        # them drains on its own, so a tier takes its slowest, not their sum).
        stop_together([*self.agents, *self.workers], 10.0)
        engines = (self.sim, *self.worker_sims, *self.extra_sims)
        stop_together([p for p in (*self.gateways, *engines) if p], 10.0)
        # The stores last, and at once: their data lives in this fleet's own
        # directory and is never started from again, and nats-server's clean
        # stop writes out every file-backed consumer (~10 ms each, hundreds of
        # lanes and pools: 3-5 s a fleet) for nobody.
        for store in (*self.redis_nodes, *self.nats_nodes):
            store.kill()
        if not keep and not os.environ.get("JETSERVE_KEEP_FLEETS"):
            self.stopped_violations = self.violations()  # the bus's log is in there
            shutil.rmtree(self.workdir)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.stop(keep=exc_type is not None)

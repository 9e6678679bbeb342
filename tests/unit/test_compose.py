"""compose.yml stays in step with the code it runs.

Every ``command:`` in compose.yml is a one-line JSON array (a valid YAML flow
sequence), so each one is checked here with jetserve's own argument parsers: a
renamed or removed flag fails this test instead of a deployment. The service
graph (health checks, depends_on, profiles, grace periods) needs a real YAML
loader: PyYAML (a dev extra) or, failing that, ``docker compose config``; without
either those tests are skipped, saying which is missing.

Authentication is on by default: every bus process finds its credential in a file
that the one-shot ``credentials`` service wrote (the paths are checked against
jetserve.credentials), the servers load the generated authorization, and no
command line holds a secret.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from jetserve import cli as jetserve_cli
from jetserve.commands.admin import ADMIN_TOKEN_ENV
from jetserve.commands.common import split_csv
from jetserve.commands.gateway import KEY_SECRET_ENV
from jetserve.credentials import Credentials
from jetserve.services import REDIS_APPENDFSYNC_DEFAULT
from sim import cli as sim_cli
from streams.auth import Role
from streams.connect import SEED_ENV
from streams.subjects import RequestClass

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
NATS_CONF = ROOT / "deploy" / "nats.conf"
JETSERVE_SERVICES = ("credentials", "sim", "gateway", "worker", "agent", "keys", "worker-gpu")
# First argument of each command that is not ours: nats-server, redis-server, vLLM.
THIRD_PARTY_HEADS = {"-c", "redis-server", "--model"}
# The services on the bus, and the role whose credential each one holds.
BUS_ROLES = {"gateway": Role.GATEWAY, "worker": Role.WORKER, "agent": Role.AGENT}
BUS_ROLES["worker-gpu"] = Role.WORKER
REDIS_PASSWORD_ENV = "JETSERVE_REDIS_PASSWORD"
# Secrets travel as files only: none of these may be set to a value.
SECRET_ENVS = (SEED_ENV, REDIS_PASSWORD_ENV, KEY_SECRET_ENV, ADMIN_TOKEN_ENV)
# Flags that would put a secret on a command line (``ps`` shows it to everyone).
SECRET_FLAGS = {"--admin-token", "--key-secret", "--seed", "--password", "--pass", "-a"}
_COMMAND_LINE = re.compile(r"^\s+command:\s*(?P<value>.*?)\s*$")


# -- commands: always checked --------------------------------------------------


def _command_lines() -> list[list[str]]:
    commands: list[list[str]] = []
    for lineno, line in enumerate(COMPOSE.read_text().splitlines(), 1):
        match = _COMMAND_LINE.match(line)
        if match is None:
            continue
        try:
            value = json.loads(match["value"])
        except json.JSONDecodeError:
            pytest.fail(f"compose.yml:{lineno}: write `command:` as a one-line JSON array")
        assert isinstance(value, list), f"compose.yml:{lineno}: command is not a list"
        assert all(isinstance(v, str) for v in value), f"compose.yml:{lineno}: non-string arg"
        commands.append(value)
    return commands


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subcommands() -> set[str]:
    return set(_subparsers(jetserve_cli.build_parser()))


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _strip_log_level(argv: list[str]) -> list[str]:
    # jetserve.cli.main hands everything after `sim` to the simulator only when
    # --log-level comes first as two separate arguments.
    return argv[2:] if argv[:1] == ["--log-level"] else argv


def _exact_options(argv: list[str]) -> set[str]:
    """The option strings of the parsers that will see ``argv``, spelled out:
    argparse accepts unambiguous prefixes, so ``--grace`` would still parse
    after a rename to ``--grace-s``."""
    head = _strip_log_level(argv)
    if head[:1] == ["sim"]:
        return _options(sim_cli.build_parser())
    parser: argparse.ArgumentParser | None = jetserve_cli.build_parser()
    found: set[str] = set()
    tokens = iter(head)
    while parser is not None:
        found |= _options(parser)
        parser = _subparsers(parser).get(next(tokens, ""))
    return found


def _parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """Parse a jetserve command line the way ``jetserve.cli.main`` does."""
    head = _strip_log_level(argv)
    exact = _exact_options(argv)
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--"):
            assert flag in exact, f"{flag} is not an option of its command: {argv}"
    try:
        if head[:1] == ["sim"]:
            return "sim", sim_cli.build_parser().parse_args(head[1:])
        return head[0], jetserve_cli.build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"compose.yml command does not parse (argparse's message above): {argv}")


def _jetserve_commands() -> list[tuple[str, argparse.Namespace, list[str]]]:
    ours = _subcommands()
    parsed = []
    for argv in _command_lines():
        head = _strip_log_level(argv)
        if head[:1] and head[0] in ours:
            name, ns = _parse(argv)
            parsed.append((name, ns, argv))
        else:
            assert argv[:1], f"unrecognised command: {argv}"
            assert argv[0] in THIRD_PARTY_HEADS, f"unrecognised command: {argv}"
    return parsed


def _by_name(name: str) -> list[argparse.Namespace]:
    return [ns for n, ns, _ in _jetserve_commands() if n == name]


def test_every_command_is_a_json_array() -> None:
    commands = _command_lines()
    # credentials, nats, redis, sim, gateway, worker, agent, keys, vllm, worker-gpu
    assert len(commands) == 10


def test_every_jetserve_command_parses() -> None:
    names = sorted(name for name, _, _ in _jetserve_commands())
    assert names == ["agent", "credentials", "gateway", "keys", "sim", "worker", "worker"]


def _credentials() -> tuple[argparse.Namespace, Credentials]:
    (ns,) = _by_name("credentials")
    return ns, Credentials(ns.dir, tuple(ns.tenant))


def test_no_command_line_holds_a_secret_or_turns_auth_off() -> None:
    for argv in _command_lines():
        assert "--insecure" not in argv, argv
        for token in argv:
            flag = token.split("=", 1)[0]
            assert flag not in SECRET_FLAGS, f"a secret on a command line: {argv}"
            if "://" in token:
                assert urlsplit(token).password is None, f"a password in a URL: {argv}"
    for _, ns, argv in _jetserve_commands():
        assert not getattr(ns, "insecure", False), argv


def test_servers_load_the_generated_authorization() -> None:
    ns, _ = _credentials()
    assert ns.tenant == ["demo"]
    assert ns.k8s_secrets is None
    assert ns.servers_dir is not None
    nats = next(argv for argv in _command_lines() if argv[:1] == ["-c"])
    # deploy/nats.conf, which includes the authorization (test_servers_mount_only_public_files).
    assert Path(nats[1]).name == NATS_CONF.name
    assert "-js" in nats
    redis = next(argv for argv in _command_lines() if argv[:1] == ["redis-server"])
    assert Path(redis[redis.index("--aclfile") + 1]) == ns.servers_dir / "redis.acl"


def test_redis_urls_name_the_acl_user_of_their_role() -> None:
    (gateway,) = _by_name("gateway")
    (agent,) = _by_name("agent")
    assert urlsplit(gateway.redis).username == "gateway"
    assert urlsplit(agent.redis).username == "agent"


def test_log_levels_are_logging_levels() -> None:
    for _, ns, argv in _jetserve_commands():
        level = getattr(ns, "log_level", None)
        if level is not None:
            assert isinstance(logging.getLevelName(level.upper()), int), argv


def test_servers_listen_beyond_loopback() -> None:
    (sim,) = _by_name("sim")
    (gateway,) = _by_name("gateway")
    assert sim.host == "0.0.0.0"
    assert gateway.host == "0.0.0.0"


def test_workers_name_valid_classes_and_a_served_engine_port() -> None:
    (sim,) = _by_name("sim")
    vllm = next(argv for argv in _command_lines() if argv[:1] == ["--model"])
    engine_ports = {sim.port, int(vllm[vllm.index("--port") + 1])}
    workers = _by_name("worker")
    assert len(workers) == 2
    for ns in workers:
        for cls in split_csv(ns.classes):
            RequestClass(cls)  # what cmd_worker does at start-up
        assert urlsplit(ns.engines[0]).port in engine_ports


def test_shared_addresses_agree() -> None:
    (gateway,) = _by_name("gateway")
    (keys,) = _by_name("keys")
    assert {ns.nats for ns in _by_name("worker")} == {gateway.nats}
    # The key tool talks to the gateway's admin API, on the port the gateway opens.
    assert keys.action == "create"
    assert keys.create_tenant
    assert keys.admin_url == f"http://gateway:{gateway.admin_port}"
    assert gateway.admin_host == "0.0.0.0"


def test_engines_serve_the_gateways_models() -> None:
    (gateway,) = _by_name("gateway")
    (sim,) = _by_name("sim")
    cfg = sim_cli.config_from_args(sim)
    models = set(split_csv(gateway.models))
    assert cfg.model in models
    assert set(split_csv(gateway.embedding_models)) <= {cfg.model, *cfg.aliases}
    vllm = next(argv for argv in _command_lines() if argv[:1] == ["--model"])
    assert vllm[vllm.index("--served-model-name") + 1] in models


# -- the service graph: needs a YAML loader ------------------------------------


def _load_compose() -> dict[str, Any]:
    if importlib.util.find_spec("yaml") is not None:
        yaml = importlib.import_module("yaml")
        loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
        return loaded
    docker = shutil.which("docker")
    if docker is not None:
        cmd = [docker, "compose", "--profile", "*", "-f", str(COMPOSE), "config", "--format"]
        proc = subprocess.run(
            [*cmd, "json"], capture_output=True, text=True, timeout=60, check=False
        )
        if proc.returncode == 0:
            rendered: dict[str, Any] = json.loads(proc.stdout)
            return rendered
    pytest.skip(
        "cannot load compose.yml: PyYAML is not installed and `docker compose config` "
        "is unavailable (no docker CLI or no compose plugin)"
    )


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    svcs: dict[str, dict[str, Any]] = _load_compose()["services"]
    return svcs


def _seconds(duration: str | int | float) -> float:
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _parsed(svc: dict[str, Any]) -> argparse.Namespace:
    return _parse(svc["command"])[1]


def _depends(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def test_services_present(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) >= {"nats", "redis", *JETSERVE_SERVICES, "vllm"}


def test_infrastructure_images(services: dict[str, dict[str, Any]]) -> None:
    nats, redis = services["nats"], services["redis"]
    assert nats["image"] == "nats:2.11-alpine"
    assert "-js" in nats["command"]
    assert "/data" in json.dumps(nats["volumes"])
    assert "8222/healthz" in " ".join(nats["healthcheck"]["test"])
    assert redis["image"] == "redis:7-alpine"
    assert "redis-cli --user admin ping" in " ".join(redis["healthcheck"]["test"])


def _mounts(svc: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Mount target -> (volume, read-only), from short or long (rendered) syntax."""
    out = {}
    for vol in svc.get("volumes", []):
        if isinstance(vol, str):
            source, target, *mode = vol.split(":")
            out[target] = (source, "ro" in mode)
        else:
            out[vol["target"]] = (vol["source"], bool(vol.get("read_only")))
    return out


def _volumes_of(svc: dict[str, Any]) -> set[str]:
    return {volume for volume, _ in _mounts(svc).values()}


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def _under(path: str | Path, mounts: dict[str, tuple[str, bool]]) -> tuple[str, bool]:
    """The volume (and its read-only flag) that holds ``path`` in a container."""
    found = [t for t in mounts if Path(path).is_relative_to(t)]
    assert found, f"{path} is on no mounted volume"
    return mounts[max(found, key=len)]


def test_credentials_are_generated_once_into_volumes(
    services: dict[str, dict[str, Any]],
) -> None:
    ns, _ = _credentials()
    svc = services["credentials"]
    # A one-shot that everything waits for; it must run with a plain `up`.
    assert svc["restart"] == "no"
    assert not svc.get("profiles")
    mounts = _mounts(svc)
    assert mounts[str(ns.dir)] == ("creds", False)
    assert mounts[str(ns.servers_dir)] == ("bus-auth", False)
    assert {"creds", "bus-auth"} <= set(_load_compose()["volumes"])
    for name, other in services.items():
        if name != "credentials":
            for volume, read_only in _mounts(other).values():
                if volume in ("creds", "bus-auth"):
                    assert read_only, f"{name} mounts {volume} writable"
        deps = _depends(other)
        if "credentials" in deps:
            assert deps["credentials"] == "service_completed_successfully", name


def test_the_image_owns_the_credential_mount_points() -> None:
    """A fresh named volume takes the owner and mode of the image's directory: the
    uid jetserve runs as must own /creds (0700) and /bus-auth (0755), so that the
    credentials service can write both and every jetserve service read its files."""
    text = DOCKERFILE.read_text()
    user = re.search(r"^USER (\d+)", text, re.M)
    assert user is not None, "the image runs as a fixed uid"
    ns, _ = _credentials()
    for path, mode in ((ns.dir, "0700"), (ns.servers_dir, "0755")):
        made = re.search(rf"install -d -o (\d+) -g \d+ -m (\d+) {path}\b", text)
        assert made is not None, f"the Dockerfile creates no {path}"
        assert made.groups() == (user[1], mode), path


def _nats_include(conf_path: str) -> str:
    """Where deploy/nats.conf's ``include`` lands when the file is at ``conf_path``
    (nats-server resolves it against the including file's directory)."""
    (include,) = re.findall(r'^include "([^"]+)"$', NATS_CONF.read_text(), re.M)
    return os.path.normpath(Path(conf_path).parent / str(include))


def _config_file(svc: dict[str, Any], target: str) -> Path:
    """The host file of the compose config mounted at ``target`` in ``svc``."""
    (source,) = [c["source"] for c in svc.get("configs", []) if c.get("target") == target]
    file = Path(_load_compose()["configs"][source]["file"])
    return (file if file.is_absolute() else COMPOSE.parent / file).resolve()


def test_servers_mount_only_public_files(services: dict[str, dict[str, Any]]) -> None:
    ns, _ = _credentials()
    nats, redis = services["nats"], services["redis"]
    conf = nats["command"][nats["command"].index("-c") + 1]
    acl = redis["command"][redis["command"].index("--aclfile") + 1]
    assert _config_file(nats, conf) == NATS_CONF.resolve()
    # The include lands on bus-auth, on the file the credentials service writes there.
    auth = _nats_include(conf)
    volume, read_only = _under(auth, _mounts(nats))
    assert (volume, read_only) == ("bus-auth", True)
    mount = max((t for t in _mounts(nats) if Path(auth).is_relative_to(t)), key=len)
    assert ns.servers_dir / Path(auth).relative_to(mount) == ns.servers_dir / "nats-auth.conf"
    assert _under(acl, _mounts(redis)) == ("bus-auth", True)
    assert "creds" not in _volumes_of(nats), "nats-server needs no secret"
    for name in ("nats", "redis"):
        assert _depends(services[name]) == {"credentials": "service_completed_successfully"}


def _k8s_args(name: str) -> list[str]:
    docs = yaml_docs(ROOT / "deploy" / f"{name}.yaml")
    (workload,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    args: list[str] = container["args"]
    return args


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra) reads deploy/")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_nats_runs_deploys_config_at_deploys_paths(services: dict[str, dict[str, Any]]) -> None:
    """The JetStream fsync policy (sync_interval "always") is deploy/nats.conf's,
    mounted where deploy/nats.yaml mounts it, so its include finds the same file."""
    nats = services["nats"]["command"]
    k8s = _k8s_args("nats")
    assert nats[:2] == k8s[:2]
    assert '  sync_interval: "always"' in NATS_CONF.read_text().splitlines()
    assert nats[2:] == k8s[2:], "the same JetStream and monitoring flags"


def test_redis_persists_as_deploy_runs_it(services: dict[str, dict[str, Any]]) -> None:
    """Append-only file on, fsynced before each reply (appendfsync always), in the
    redis-data volume: keys, limits and spend survive a crash (docs/reliability.md)."""
    redis = services["redis"]
    argv = redis["command"]

    def persistence(args: list[str]) -> dict[str, str]:
        flags = ("--appendonly", "--appendfsync", "--dir", "--save")
        return {a: b for a, b in itertools.pairwise(args) if a in flags}

    assert persistence(argv) == persistence(_k8s_args("redis"))
    assert persistence(argv) == {
        "--appendonly": "yes",
        "--appendfsync": REDIS_APPENDFSYNC_DEFAULT,
        "--dir": "/data",
    }
    assert _under("/data", _mounts(redis)) == ("redis-data", False)


def test_redis_health_check_authenticates_without_argv_secrets(
    services: dict[str, dict[str, Any]],
) -> None:
    _, creds = _credentials()
    redis = services["redis"]
    kind, check = redis["healthcheck"]["test"]
    assert kind == "CMD-SHELL"
    password = creds.redis_password_file("admin")
    assert f"cat {password}" in check
    assert "REDISCLI_AUTH=" in check  # not --pass: redis-cli's argv is visible
    assert "grep -q PONG" in check  # redis-cli exits 0 on NOAUTH too
    for flag in ("--pass", " -a "):
        assert flag not in check
    assert _under(password, _mounts(redis)) == ("creds", True)


def test_every_bus_process_has_its_roles_credential(
    services: dict[str, dict[str, Any]],
) -> None:
    _, creds = _credentials()
    for name, role in BUS_ROLES.items():
        svc, env = services[name], _env(services[name])
        mounts = _mounts(svc)
        assert env.get(f"{SEED_ENV}_FILE") == str(creds.seed_file(role)), name
        assert _under(env[f"{SEED_ENV}_FILE"], mounts) == ("creds", True), name
        assert _depends(svc).get("credentials") == "service_completed_successfully", name
        redis_url = getattr(_parsed(svc), "redis", None)
        if redis_url is None:
            assert f"{REDIS_PASSWORD_ENV}_FILE" not in env, name
            continue
        user = urlsplit(redis_url).username
        assert user is not None, f"{name}: the Redis URL names no ACL user"
        assert env.get(f"{REDIS_PASSWORD_ENV}_FILE") == str(creds.redis_password_file(user))
    gateway = _env(services["gateway"])
    assert gateway[f"{KEY_SECRET_ENV}_FILE"] == str(creds.key_secret_file)
    assert gateway[f"{ADMIN_TOKEN_ENV}_FILE"] == str(creds.admin_token_file)
    # The key tool reads the admin token from the same file.
    keys = services["keys"]
    assert _env(keys)[f"{ADMIN_TOKEN_ENV}_FILE"] == str(creds.admin_token_file)
    assert _under(creds.admin_token_file, _mounts(keys)) == ("creds", True)
    # The simulator is on no bus: it gets no credential.
    assert "creds" not in _volumes_of(services["sim"])


def test_no_secret_by_value_in_the_environment(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        env = _env(svc)
        for var in SECRET_ENVS:
            assert var not in env, f"{name}: {var} by value; use {var}_FILE"


def test_one_image_for_every_jetserve_process(services: dict[str, dict[str, Any]]) -> None:
    images = {services[name]["image"] for name in JETSERVE_SERVICES}
    assert len(images) == 1
    for name in JETSERVE_SERVICES:
        assert "build" in services[name], name


def test_restart_policies(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if name == "keys":
            # A one-shot: restarting it would mint a new key on every exit.
            assert svc["restart"] == "no"
            assert svc.get("profiles"), "keys must not start with `docker compose up`"
        elif name == "credentials":
            # A one-shot the others wait for (service_completed_successfully).
            assert svc["restart"] == "no"
        else:
            assert svc["restart"] == "unless-stopped", name


def test_depends_on_waits_for_health(services: dict[str, dict[str, Any]]) -> None:
    want = {
        "gateway": {"credentials", "nats", "redis"},
        "worker": {"credentials", "nats", "sim"},
        "worker-gpu": {"credentials", "nats", "vllm"},
        "agent": {"credentials", "nats", "redis"},
        "keys": {"gateway"},
    }
    for name, deps in want.items():
        got = _depends(services[name])
        assert set(got) == deps, name
        for dep, condition in got.items():
            if dep == "credentials":
                assert condition == "service_completed_successfully", name
                continue
            assert condition == "service_healthy", (name, dep)
            assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has none"


def test_addresses_name_services(services: dict[str, dict[str, Any]]) -> None:
    for name in JETSERVE_SERVICES:
        ns = _parsed(services[name])
        for attr in ("nats", "redis", "engine"):
            url = getattr(ns, attr, None)
            if url is not None:
                assert urlsplit(url).hostname in services, (name, attr, url)
    assert urlsplit(_parsed(services["worker"]).engines[0]).hostname == "sim"
    assert urlsplit(_parsed(services["worker-gpu"]).engines[0]).hostname == "vllm"


def test_gateway_published_and_probed_on_readyz(services: dict[str, dict[str, Any]]) -> None:
    gw = services["gateway"]
    ns = _parsed(gw)
    assert str(ns.port) in json.dumps(gw["ports"])
    assert f"{ns.port}/readyz" in " ".join(gw["healthcheck"]["test"])
    # /metrics is on its own listener, published on the host's loopback only.
    assert ns.metrics_port is not None
    assert ns.metrics_host == "0.0.0.0"
    hosts = [ip for ip, target in _published(gw) if target == ns.metrics_port]
    assert hosts == ["127.0.0.1"], hosts


def _published(svc: dict[str, Any]) -> list[tuple[str | None, int]]:
    """(host address, container port) of each published port, short or long syntax."""
    out: list[tuple[str | None, int]] = []
    for port in svc.get("ports", []):
        if isinstance(port, dict):  # `docker compose config` renders the long syntax
            out.append((port.get("host_ip"), int(port["target"])))
            continue
        match = re.fullmatch(r"(?:(\d+\.\d+\.\d+\.\d+):)?.*:(\d+)", str(port))
        assert match is not None, port
        out.append((match[1], int(match[2])))
    return out


def test_workers_drain_before_sigkill(services: dict[str, dict[str, Any]]) -> None:
    assert services["worker"]["deploy"]["replicas"] == 2
    for name in ("worker", "worker-gpu", "gateway"):
        svc = services[name]
        grace = _parsed(svc).grace
        assert grace < _seconds(svc["stop_grace_period"]), name
    assert _seconds(services["worker"]["stop_grace_period"]) == 30


def test_gpu_profile(services: dict[str, dict[str, Any]]) -> None:
    vllm = services["vllm"]
    assert vllm["profiles"] == ["gpu"]
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert vllm["image"] == "vllm/vllm-openai:latest"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    port = int(vllm["command"][vllm["command"].index("--port") + 1])
    assert urlsplit(_parsed(services["worker-gpu"]).engines[0]).port == port
    for name, svc in services.items():
        if name not in ("vllm", "worker-gpu", "keys"):
            assert not svc.get("profiles"), f"{name} should start by default"

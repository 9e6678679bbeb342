"""deploy/ stays in step with the code it runs, without a cluster or kubectl.

- Every YAML document under deploy/ parses, and kustomization.yaml lists every file.
- Every KEDA ScaledObject scales on its class's whole lag through KEDA's Prometheus
  scaler, with a query that names only metrics the gateway exports, with the class's
  label; its floor trigger names the stream and a consumer that jetserve really
  creates (streams.definitions.DEFAULT_TOPOLOGY); it scales a Deployment defined
  here whose worker serves exactly that class, and both thresholds are that
  worker's --max-inflight.
- Every jetserve command line parses with jetserve's own parsers, with exact option
  names (argparse would accept abbreviations: a renamed flag must fail here).
- The Grafana dashboard parses, and its queries name only metrics that exist: the
  gateway's (introspected from gateway.metrics) or the documented worker metrics.
- Authentication is on: every bus process reads its role's credential from a file of
  the Secret that ``jetserve credentials --k8s-secrets`` generates for that role,
  nats-server and redis-server load the generated authorization, and no command
  line, URL or environment value holds a secret.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml  # type: ignore[import-untyped]

from gateway.metrics import GatewayMetrics
from jetserve import cli as jetserve_cli
from jetserve.commands.admin import ADMIN_TOKEN_ENV
from jetserve.commands.common import split_csv
from jetserve.commands.credentials import k8s_secrets
from jetserve.commands.gateway import KEY_SECRET_ENV
from jetserve.credentials import generate
from jetserve.scale import (
    OptionError,
    Policy,
    ScaleError,
    desired_replicas,
    jsz_url,
    lags_from_jsz,
    per_class,
)
from jetserve.services import (
    NATS_SYNC_DEFAULT,
    REDIS_APPENDFSYNC_DEFAULT,
    check_nats_sync,
    free_port,
    nats_server_binary,
    nats_server_conf,
    start_nats,
    start_redis,
    wait_port,
)
from sim import cli as sim_cli
from streams.auth import Role
from streams.connect import SEED_ENV
from streams.definitions import DEFAULT_TOPOLOGY
from streams.pools import pool_consumer_configs
from streams.subjects import RequestClass
from workers.inference.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "jetserve-dashboard.json"
NATS_CONF = DEPLOY / "nats.conf"
NAMESPACE = "jetserve"
CLUSTER_SCOPED = {"Namespace"}

# The worker's Prometheus metrics the dashboard may query, as (type, labels). The
# worker serves them itself (workers/inference/metrics.py); test_worker_metric_list_is_current
# checks this list against that module. Names follow the OpenTelemetry GenAI
# conventions where one exists (gen_ai_server_*), else jetserve_worker_*.
WORKER_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "jetserve_worker_requests": ("counter", ("cls", "outcome")),
    "jetserve_worker_redeliveries": ("counter", ("cls", "reason")),
    "jetserve_worker_tokens": ("counter", ("cls", "type")),
    "jetserve_worker_inflight": ("gauge", ()),
    "jetserve_worker_kv_headroom_ratio": ("gauge", ()),
    "jetserve_worker_engine_waiting": ("gauge", ()),
    "jetserve_worker_engine_kv_usage_ratio": ("gauge", ()),
    "jetserve_worker_engine_up": ("gauge", ()),
    "jetserve_worker_capped_seconds": ("counter", ()),
    "gen_ai_server_time_to_first_token_seconds": ("histogram", ("cls",)),
    "gen_ai_server_time_per_output_token_seconds": ("histogram", ("cls",)),
    "gen_ai_server_request_duration_seconds": ("histogram", ("cls",)),
}
# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = {"instance", "job"}
REDIS_PASSWORD_ENV = "JETSERVE_REDIS_PASSWORD"
# Secrets travel as mounted files only: none of these may be set to a value.
SECRET_ENVS = (SEED_ENV, REDIS_PASSWORD_ENV, KEY_SECRET_ENV, ADMIN_TOKEN_ENV)
# Flags that would put a secret on a command line (``ps`` shows it to everyone).
SECRET_FLAGS = {"--admin-token", "--key-secret", "--seed", "--password", "--pass", "-a"}
CREDENTIALS_STEP = "jetserve credentials --dir ./creds --tenant <t> --k8s-secrets jetserve"


# -- loading --------------------------------------------------------------------


def _yaml_files() -> list[Path]:
    return sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))


def _documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in _yaml_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert isinstance(doc, dict), f"{path}: a document is not a mapping"
                yield path, doc


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path, doc in _documents():
        if doc.get("kind") == "Kustomization":
            continue
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in found, f"{path}: {key} defined twice"
        found[key] = doc
    return found


OBJECTS = _objects()


def _of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {name: obj for (k, name), obj in OBJECTS.items() if k == kind}


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = _pod_spec(workload)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _is_jetserve(container: dict[str, Any]) -> bool:
    image = str(container["image"]).rsplit("/", 1)[-1]
    return image.split(":", 1)[0].split("@", 1)[0] == "jetserve"


def _argv(container: dict[str, Any]) -> list[str]:
    # The image's ENTRYPOINT is `jetserve`: `args` are its command line.
    assert container.get("command") in (None, ["jetserve"]), container["name"]
    args = container.get("args", [])
    assert all(isinstance(a, str) for a in args), f"{container['name']}: non-string arg"
    return list(args)


# -- jetserve command lines -------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _head(argv: list[str]) -> list[str]:
    # jetserve.cli.main hands everything after `sim` to the simulator's parser.
    return argv[2:] if argv[:1] == ["--log-level"] else argv


def _parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """Parse a jetserve command line as ``jetserve.cli.main`` does, option names exact."""
    head = _head(argv)
    if head[:1] == ["sim"]:
        exact = _options(jetserve_cli.build_parser()) | _options(sim_cli.build_parser())
    else:
        exact, tokens = set(), iter(head)
        parser: argparse.ArgumentParser | None = jetserve_cli.build_parser()
        while parser is not None:
            exact |= _options(parser)
            parser = _subparsers(parser).get(next(tokens, ""))
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("-") and not flag.lstrip("-").isdigit():
            assert flag in exact, f"{flag} is not an option of its command: {argv}"
    try:
        if head[:1] == ["sim"]:
            return "sim", sim_cli.build_parser().parse_args(head[1:])
        return head[0], jetserve_cli.build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"command line does not parse (argparse's message above): {argv}")


@functools.cache
def _commands() -> list[tuple[str, str, dict[str, Any], argparse.Namespace]]:
    """(workload, command, container, namespace) for every jetserve container."""
    out = []
    for (kind, name), obj in OBJECTS.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        for container in _containers(obj):
            if _is_jetserve(container):
                command, ns = _parse(_argv(container))
                out.append((name, command, container, ns))
    return out


def _container(workload: str, command: str) -> tuple[dict[str, Any], argparse.Namespace]:
    found = [(c, ns) for w, cmd, c, ns in _commands() if w == workload and cmd == command]
    assert len(found) == 1, f"{workload}: expected one `{command}` container, got {len(found)}"
    return found[0]


def _workers() -> dict[str, tuple[dict[str, Any], argparse.Namespace]]:
    return {w: (c, ns) for w, cmd, c, ns in _commands() if cmd == "worker"}


# -- the manifests ------------------------------------------------------------------


def test_every_yaml_file_is_a_kustomize_resource() -> None:
    (kustomization,) = [doc for _, doc in _documents() if doc.get("kind") == "Kustomization"]
    listed = {DEPLOY / r for r in kustomization["resources"]}
    for path in listed:
        assert path.is_file(), f"kustomization.yaml lists a missing file: {path}"
    files = {p for p in _yaml_files() if p.name != "kustomization.yaml"}
    assert files == listed, f"not in kustomization.yaml: {sorted(map(str, files - listed))}"
    assert kustomization["namespace"] == NAMESPACE
    for generator in kustomization.get("configMapGenerator", []):
        for file in generator["files"]:
            assert (DEPLOY / file.split("=", 1)[-1]).is_file(), file


def test_every_object_is_named_and_namespaced() -> None:
    assert len(OBJECTS) >= 15
    for (kind, name), obj in OBJECTS.items():
        assert obj.get("apiVersion"), (kind, name)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (kind, name)
        if kind not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") == NAMESPACE, (kind, name)
    assert ("Namespace", NAMESPACE) in OBJECTS


def test_every_jetserve_command_parses_with_exact_options() -> None:
    commands = sorted((workload, command) for workload, command, _, _ in _commands())
    workers = [f"worker-{cls.value}" for cls in RequestClass]
    assert commands == sorted(
        [("gateway", "gateway"), ("agent-executor", "agent")]
        + [(w, "worker") for w in workers]
        + [(w, "sim") for w in workers]  # each worker's engine (a sidecar)
    )


def test_k8s_variable_references_are_defined() -> None:
    for _, _, container, _ in _commands():
        defined = {e["name"] for e in container.get("env", [])}
        for arg in _argv(container):
            for var in re.findall(r"\$\((\w+)\)", arg):
                assert var in defined, f"{container['name']}: $({var}) is not in its env"


def test_services_select_pods_and_name_their_ports() -> None:
    workloads = {**_of_kind("Deployment"), **_of_kind("StatefulSet")}
    for name, svc in _of_kind("Service").items():
        selector = svc["spec"]["selector"]
        matched = [
            w
            for w in workloads.values()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matched, f"Service {name} selects no pods"
        for w in matched:
            ports = {p.get("name") for c in _containers(w) for p in c.get("ports", [])}
            ports |= {p["containerPort"] for c in _containers(w) for p in c.get("ports", [])}
            for port in svc["spec"]["ports"]:
                assert port.get("targetPort", port["port"]) in ports, (name, port)
    for name, w in workloads.items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), name


def _service_port(host: str, port: int) -> None:
    """``host`` names a Service here (short or cluster-local name) that exposes ``port``."""
    parts = host.split(".")
    assert parts[1:] in ([], [NAMESPACE], [NAMESPACE, "svc", "cluster", "local"]), host
    svc = _of_kind("Service").get(parts[0])
    assert svc is not None, f"no Service {parts[0]} in deploy/"
    assert port in {p["port"] for p in svc["spec"]["ports"]}, (host, port)


def test_configmap_addresses_name_services() -> None:
    data = _of_kind("ConfigMap")["jetserve-config"]["data"]
    for key, scheme in (
        ("JETSERVE_NATS_URL", "nats"),
        ("JETSERVE_REDIS_URL", "redis"),
        ("JETSERVE_ADMIN_URL", "http"),
    ):
        url = urlsplit(data[key])
        assert url.scheme == scheme, key
        assert url.hostname, key
        assert url.port, key
        _service_port(url.hostname, url.port)
    # jetserve reads these from the environment (the defaults of --nats/--redis).
    for workload, command, container, _ in _commands():
        if command in ("gateway", "worker"):
            refs = [e["configMapRef"]["name"] for e in container.get("envFrom", [])]
            assert "jetserve-config" in refs, workload


def test_gateway_ports_probes_and_services() -> None:
    container, ns = _container("gateway", "gateway")
    assert ns.host == "0.0.0.0"
    assert ns.admin_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": ns.port, "admin": ns.admin_port, "metrics": ns.metrics_port}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == ns.port
    # The admin API has its own ClusterIP Service; the public one does not carry it,
    # and no Service carries /metrics (Prometheus scrapes the pods).
    services = _of_kind("Service")
    public, admin = services["gateway"]["spec"], services["gateway-admin"]["spec"]
    assert {p["targetPort"] for p in public["ports"]} == {"http"}
    assert {p["targetPort"] for p in admin["ports"]} == {"admin"}
    assert admin["type"] == "ClusterIP"
    # preStop (endpoints drop this pod), then --grace for open streams, before SIGKILL.
    pod = _pod_spec(OBJECTS[("Deployment", "gateway")])
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(sleep[1]) + ns.grace + 5


def test_metrics_are_scraped_where_they_are_served() -> None:
    """Prometheus annotations name the port that serves /metrics: the gateway's and
    the worker's --metrics-port (bound beyond loopback; the gateway's public port
    serves no /metrics)."""
    _, gateway = _container("gateway", "gateway")
    assert gateway.metrics_host == "0.0.0.0"
    assert gateway.metrics_port not in (None, gateway.port, gateway.admin_port)
    served = {"gateway": gateway.metrics_port}
    for workload, (container, worker) in _workers().items():
        assert worker.metrics_host == "0.0.0.0", workload
        served[workload] = worker.metrics_port
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == worker.metrics_port, workload
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            get = container[probe]["httpGet"]
            assert (get["path"], ports.get(get["port"], get["port"])) == (path, ports["metrics"])
    for workload, port in served.items():
        notes = OBJECTS[("Deployment", workload)]["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true", workload
        assert notes["prometheus.io/port"] == str(port), workload
        assert notes["prometheus.io/path"] == "/metrics", workload


def test_workers_drain_before_sigkill() -> None:
    for workload, (_, ns) in _workers().items():
        pod = _pod_spec(OBJECTS[("Deployment", workload)])
        assert pod["terminationGracePeriodSeconds"] >= ns.grace + 5, workload


def test_each_worker_has_its_own_engine_sized_like_it() -> None:
    """The engine is a native sidecar (starts first, stops after the worker drains),
    and --max-inflight is its max_num_seqs."""
    for workload, (_, worker) in _workers().items():
        sim, ns = _container(workload, "sim")
        assert sim in _pod_spec(OBJECTS[("Deployment", workload)])["initContainers"]
        assert sim["restartPolicy"] == "Always"
        assert sim["startupProbe"]["httpGet"]["port"] == ns.port
        (url,) = worker.engines
        engine = urlsplit(url)
        assert engine.hostname in ("127.0.0.1", "localhost")
        assert engine.port == ns.port
        assert sim_cli.config_from_args(ns).max_num_seqs == worker.max_inflight, workload


def test_nats_serves_jetstream_and_monitoring() -> None:
    (nats,) = [c for c in _containers(OBJECTS[("StatefulSet", "nats")]) if c["name"] == "nats"]
    args = nats["args"]
    assert "-js" in args
    monitor = int(args[args.index("-m") + 1])
    assert monitor in {p["containerPort"] for p in nats["ports"]}


# -- authentication -------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated_secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Secret name -> its keys, as `jetserve credentials --k8s-secrets` prints them."""
    creds = generate(tmp_path_factory.mktemp("creds"), ("demo",))
    out: dict[str, set[str]] = {}
    for text in k8s_secrets(creds, NAMESPACE).split("\n---\n"):
        doc = json.loads(text)
        assert doc["kind"] == "Secret"
        assert doc["metadata"]["namespace"] == NAMESPACE
        out[doc["metadata"]["name"]] = set(doc["data"])
    return out


def _secret_volumes(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    volumes = _pod_spec(workload).get("volumes", [])
    return {v["name"]: v["secret"] for v in volumes if "secret" in v}


def _secret_file(workload: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) whose mounted file ``path`` is in ``container``; read-only."""
    mounts = [
        m for m in container.get("volumeMounts", []) if Path(path).is_relative_to(m["mountPath"])
    ]
    assert mounts, f"{container['name']}: {path} is on no mounted volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert mount.get("readOnly") is True, f"{container['name']}: {mount['name']} is writable"
    secret = _secret_volumes(workload).get(mount["name"])
    assert secret is not None, f"{container['name']}: {path} is not from a Secret"
    rel = Path(path).relative_to(mount["mountPath"]).as_posix()
    items = secret.get("items")
    key = {i["path"]: i["key"] for i in items}.get(rel) if items else rel
    assert key is not None, f"{container['name']}: {path} is no item of its Secret"
    return secret["secretName"], key


def _env_value(container: dict[str, Any], name: str) -> str | None:
    """What ``$name`` is in ``container``: its own env first, then its envFrom ConfigMaps."""
    for e in container.get("env", []):
        if e["name"] == name:
            if "value" in e:
                return str(e["value"])
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            assert ref is not None, f"{container['name']}: {name} is not a plain value"
            return str(OBJECTS[("ConfigMap", ref["name"])]["data"][ref["key"]])
    for source in container.get("envFrom", []):
        data = OBJECTS[("ConfigMap", source["configMapRef"]["name"])]["data"]
        if name in data:
            return str(data[name])
    return None


def _all_containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for (kind, name), obj in OBJECTS.items():
        if kind in ("Deployment", "StatefulSet"):
            for container in _containers(obj):
                yield name, obj, container


def _probe_commands(container: dict[str, Any]) -> list[list[str]]:
    probes = ("readinessProbe", "livenessProbe", "startupProbe")
    return [container[p]["exec"]["command"] for p in probes if "exec" in container.get(p, {})]


def test_no_command_line_holds_a_secret_or_turns_auth_off() -> None:
    for workload, _, container in _all_containers():
        argv = [*container.get("command", []), *container.get("args", [])]
        argv += [a for cmd in _probe_commands(container) for a in cmd]
        assert "--insecure" not in argv, (workload, container["name"])
        for token in argv:
            assert token.split("=", 1)[0] not in SECRET_FLAGS, (workload, token)
            for url in re.findall(r"\w+://\S+", token):
                assert urlsplit(url).password is None, (workload, "a password in a URL")
    for _, _, _, ns in _commands():
        assert not getattr(ns, "insecure", False)
    for name, cm in _of_kind("ConfigMap").items():
        for key, value in cm.get("data", {}).items():
            if "://" in str(value):
                assert urlsplit(str(value)).password is None, (name, key)


def test_no_secret_by_value_in_the_environment() -> None:
    for workload, _, container in _all_containers():
        for e in container.get("env", []):
            assert e["name"] not in SECRET_ENVS, f"{workload}: {e['name']}; use {e['name']}_FILE"
            assert "secretKeyRef" not in e.get("valueFrom", {}), (workload, e["name"])
    for name, cm in _of_kind("ConfigMap").items():
        assert not set(cm.get("data", {})) & set(SECRET_ENVS), name


def test_every_secret_used_is_one_the_credentials_command_makes(
    generated_secrets: dict[str, set[str]],
) -> None:
    assert {f"jetserve-{r.value}" for r in Role if r is not Role.SERVICE} | {
        "jetserve-service-demo",
        "jetserve-bus-auth",
    } == set(generated_secrets)
    used = 0
    for (kind, name), obj in OBJECTS.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        for volume, secret in _secret_volumes(obj).items():
            keys = generated_secrets.get(secret["secretName"])
            assert keys is not None, f"{name}: no such Secret: {secret['secretName']}"
            for item in secret.get("items", []):
                assert item["key"] in keys, (name, volume, item["key"])
            used += 1
    assert used >= 8  # nats, redis (2), gateway, agent and each worker


def test_every_bus_process_has_its_roles_credential() -> None:
    seen = set()
    for workload, command, container, ns in _commands():
        if command == "sim":
            # The engine is on no bus: it gets no credential.
            assert not container.get("volumeMounts"), workload
            continue
        obj = OBJECTS[("Deployment", workload)]
        role = Role(command)
        seen.add(role)
        seed = _env_value(container, f"{SEED_ENV}_FILE")
        assert seed is not None, f"{workload}: no {SEED_ENV}_FILE"
        assert _secret_file(obj, container, seed) == (f"jetserve-{role.value}", "nats.nk")
        redis_env = _env_value(container, "JETSERVE_REDIS_URL")
        url = ns.redis if "--redis" in _argv(container) else redis_env
        password = _env_value(container, f"{REDIS_PASSWORD_ENV}_FILE")
        if command in ("gateway", "agent"):
            assert url is not None, f"{workload}: no Redis URL"
            assert urlsplit(url).username == role.value, (workload, url)
            _service_port(str(urlsplit(url).hostname), int(urlsplit(url).port or 6379))
            assert password is not None, f"{workload}: no {REDIS_PASSWORD_ENV}_FILE"
            want = (f"jetserve-{role.value}", "redis.password")
            assert _secret_file(obj, container, password) == want
        else:
            assert password is None, workload
        if command == "gateway":
            for var, key in ((KEY_SECRET_ENV, "key_secret"), (ADMIN_TOKEN_ENV, "admin_token")):
                path = _env_value(container, f"{var}_FILE")
                assert path is not None, f"gateway: no {var}_FILE"
                assert _secret_file(obj, container, path) == ("jetserve-gateway", key)
    assert seen == {Role.GATEWAY, Role.WORKER, Role.AGENT}


def test_mounted_secrets_are_readable_by_the_pods_user() -> None:
    """A Secret's files are root's: a pod that runs as uid 10001 reads them through
    fsGroup, so its mode must let the group read."""
    for (kind, name), obj in OBJECTS.items():
        if kind not in ("Deployment", "StatefulSet") or not _secret_volumes(obj):
            continue
        pod = _pod_spec(obj).get("securityContext", {})
        if pod.get("runAsUser", 0) == 0:
            continue  # root, or the image's own user-switching entrypoint (redis, nats)
        assert pod.get("fsGroup") == pod.get("runAsGroup"), name
        for secret in _secret_volumes(obj).values():
            mode = secret.get("defaultMode", 0o644)
            assert mode & 0o040, f"{name}: {oct(mode)} hides {secret['secretName']} from its group"
            assert not mode & 0o007, f"{name}: {secret['secretName']} is world-readable"


def test_servers_load_the_generated_authorization() -> None:
    nats_set = OBJECTS[("StatefulSet", "nats")]
    (nats,) = [c for c in _containers(nats_set) if c["name"] == "nats"]
    args = nats["args"]
    assert args[0] == "-c", "the config file first: the flags after it override it"
    # deploy/nats.conf includes the authorization, relative to its own directory.
    assert _config_file(nats_set, nats, args[1]) == NATS_CONF.name
    auth = _nats_include(args[1])
    assert _secret_file(nats_set, nats, auth) == ("jetserve-bus-auth", "nats-auth.conf")

    redis_set = OBJECTS[("StatefulSet", "redis")]
    (redis,) = [c for c in _containers(redis_set) if c["name"] == "redis"]
    acl = redis["args"][redis["args"].index("--aclfile") + 1]
    assert _secret_file(redis_set, redis, acl) == ("jetserve-bus-auth", "redis.acl")
    # Its probes PING as admin: the password from a file, through REDISCLI_AUTH.
    probes = _probe_commands(redis)
    assert len(probes) == 2
    for probe in probes:
        assert probe[:2] == ["sh", "-c"]
        check = probe[2]
        assert "redis-cli --user admin ping" in check
        assert "grep -q PONG" in check  # redis-cli exits 0 on NOAUTH too
        (path,) = re.findall(r'REDISCLI_AUTH="\$\(cat (\S+)\)"', check)
        assert _secret_file(redis_set, redis, path) == ("jetserve-admin", "redis.password")
    # Only that key of the admin Secret: its nkey seed (the whole bus) stays out.
    for secret in _secret_volumes(redis_set).values():
        if secret["secretName"] == "jetserve-admin":
            assert [i["key"] for i in secret["items"]] == ["redis.password"]


# -- durability (docs/reliability.md#durability-settings) ---------------------------


def _config_file(workload: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The key of the generated ConfigMap (kustomization.yaml) that is ``path``."""
    mounts = [
        m for m in container.get("volumeMounts", []) if Path(path).is_relative_to(m["mountPath"])
    ]
    assert mounts, f"{container['name']}: {path} is on no mounted volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert mount.get("readOnly") is True, f"{container['name']}: {mount['name']} is writable"
    volume = {v["name"]: v for v in _pod_spec(workload)["volumes"]}[mount["name"]]
    name = volume["configMap"]["name"]
    (kustomization,) = [doc for _, doc in _documents() if doc.get("kind") == "Kustomization"]
    (generator,) = [g for g in kustomization["configMapGenerator"] if g["name"] == name]
    rel = Path(path).relative_to(mount["mountPath"]).as_posix()
    assert rel in generator["files"], (name, rel)
    return rel


def _nats_include(conf_path: str) -> str:
    """Where deploy/nats.conf's ``include`` lands when the file is at ``conf_path``
    (nats-server resolves it against the including file's directory)."""
    (include,) = re.findall(r'^include "([^"]+)"$', NATS_CONF.read_text(), re.M)
    return os.path.normpath(Path(conf_path).parent / str(include))


def _significant(conf: str) -> list[str]:
    return [ln.strip() for ln in conf.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _nats_container() -> tuple[dict[str, Any], dict[str, Any]]:
    nats_set = OBJECTS[("StatefulSet", "nats")]
    (nats,) = [c for c in _containers(nats_set) if c["name"] == "nats"]
    return nats_set, nats


def test_nats_fsyncs_every_write_as_the_launcher_does() -> None:
    """deploy/nats.conf is what jetserve.services renders for its own servers,
    with the default policy (sync_interval "always"), for the pod's paths."""
    _, nats = _nats_container()
    conf = nats["args"][1]
    rendered = nats_server_conf(NATS_SYNC_DEFAULT, Path(conf).parent, Path(_nats_include(conf)))
    assert NATS_SYNC_DEFAULT == "always"
    assert _significant(NATS_CONF.read_text()) == _significant(rendered)


def test_deploys_nats_conf_runs_with_fsync_always_and_auth(tmp_path: Path) -> None:
    """The real nats-server, given deploy/nats.conf at the pod's layout (the
    include at /etc/nats-auth): JetStream fsyncs every write, auth is on."""
    _, nats = _nats_container()
    conf = Path(nats["args"][1])
    root = tmp_path / "root"
    here = root / conf.relative_to("/")
    here.parent.mkdir(parents=True)
    here.write_text(NATS_CONF.read_text())
    auth = root / Path(_nats_include(str(conf))).relative_to("/")
    auth.parent.mkdir(parents=True)
    auth.write_text(generate(tmp_path / "creds", ("demo",)).nats_conf.read_text())
    port, monitor = free_port(), free_port()
    flags = ["-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js"]
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(here), *flags, "-sd", str(tmp_path / "js")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_port(monitor, 10.0, proc)
        varz = httpx.get(f"http://127.0.0.1:{monitor}/varz", timeout=5).json()
    finally:
        proc.kill()
        proc.wait()
    assert varz["jetstream"]["config"]["sync_always"] is True
    assert varz["auth_required"] is True


def test_redis_fsyncs_its_append_only_file_before_each_reply() -> None:
    (redis,) = [c for c in _containers(OBJECTS[("StatefulSet", "redis")]) if c["name"] == "redis"]
    args = redis["args"]
    want = {("--appendonly", "yes"), ("--appendfsync", REDIS_APPENDFSYNC_DEFAULT)}
    assert want | {("--dir", "/data")} <= _flag_values(args)
    assert REDIS_APPENDFSYNC_DEFAULT == "always"
    assert {m["mountPath"]: m["name"] for m in redis["volumeMounts"]}["/data"] == "data"


def _flag_values(args: list[str]) -> set[tuple[str, str]]:
    return {(a, b) for a, b in itertools.pairwise(args) if a.startswith("--")}


def test_the_launcher_starts_servers_as_deploy_configures_them(tmp_path: Path) -> None:
    """jetserve.services (the fleet's and the tests' servers) with its defaults:
    the same nats.conf policy and the same Redis persistence flags as deploy/."""
    (redis,) = [c for c in _containers(OBJECTS[("StatefulSet", "redis")]) if c["name"] == "redis"]
    want = {f for f in _flag_values(redis["args"]) if f[0] in ("--appendonly", "--appendfsync")}
    svc = start_redis(tmp_path / "redis")
    try:
        assert want <= _flag_values(svc.args)
        assert ("--dir", str(tmp_path / "redis")) in _flag_values(svc.args)
    finally:
        svc.stop()
    nats = start_nats(tmp_path / "nats")
    try:
        assert _significant((tmp_path / "nats" / "nats.conf").read_text()) == _significant(
            nats_server_conf(NATS_SYNC_DEFAULT, tmp_path)
        )
    finally:
        nats.stop()


@pytest.mark.parametrize(
    ("sync", "always", "interval_s"), [("always", True, 120.0), ("1s", False, 1.0)]
)
def test_the_launchers_sync_setting_reaches_nats_server(
    tmp_path: Path, sync: str, always: bool, interval_s: float
) -> None:
    monitor = free_port()
    svc = start_nats(tmp_path, cluster=["-m", str(monitor)], sync=sync)
    try:
        wait_port(monitor, 10.0, svc.proc)
        config = httpx.get(f"http://127.0.0.1:{monitor}/varz", timeout=5).json()["jetstream"]
    finally:
        svc.stop()
    assert config["config"].get("sync_always", False) is always
    assert config["config"]["sync_interval"] == interval_s * 1e9


def test_nats_sync_values() -> None:
    for ok in ("always", "2m", "1s", "500ms", "1h30m", "1.5s"):
        assert check_nats_sync(ok) == ok
    for bad in ("", "0s", "2", "2 m", "never", "ALWAYS", "2m;", "1d"):
        with pytest.raises(ValueError, match="nats sync"):
            check_nats_sync(bad)
    up = jetserve_cli.build_parser().parse_args(["up"])
    assert up.nats_sync == NATS_SYNC_DEFAULT
    assert jetserve_cli.build_parser().parse_args(["up", "--nats-sync", "2m"]).nats_sync == "2m"
    with pytest.raises(SystemExit):
        jetserve_cli.build_parser().parse_args(["up", "--nats-sync", "sometimes"])


def test_keda_reads_the_unauthenticated_monitoring_port() -> None:
    """KEDA reads /jsz from nats-server's monitoring port, which the authorization
    block does not cover: no TriggerAuthentication, and the port is nats's -m."""
    (nats,) = [c for c in _containers(OBJECTS[("StatefulSet", "nats")]) if c["name"] == "nats"]
    monitor = nats["args"][nats["args"].index("-m") + 1]
    for name, so in _of_kind("ScaledObject").items():
        trigger = _trigger(so, "nats-jetstream")
        assert "authenticationRef" not in trigger, name
        assert trigger["metadata"]["natsServerMonitoringEndpoint"].endswith(f":{monitor}")


def test_manifests_with_credentials_say_how_to_make_them() -> None:
    files = {path for path, doc in _documents() if "secret" in json.dumps(doc).lower()}
    files |= {DEPLOY / "kustomization.yaml", DEPLOY / "configmap.yaml"}
    for path in files:
        assert CREDENTIALS_STEP in path.read_text(), f"{path.name}: no credentials step"


# -- KEDA ---------------------------------------------------------------------------


def _trigger(so: dict[str, Any], kind: str) -> dict[str, Any]:
    (trigger,) = [t for t in so["spec"]["triggers"] if t["type"] == kind]
    return trigger  # type: ignore[no-any-return]


# The deployment deploy/'s workers serve (no --deployment-name: the engine's model).
WORKER_DEPLOYMENT = "sim-8b"


def keda_lag_query(cls: str) -> str:
    """The whole lag of a class's workers, as the ScaledObjects query it (and the
    dashboard): the class's shared queue, their deployment's pool of the class
    (its routed requests: only they take them), and both held for their turn."""
    dep = WORKER_DEPLOYMENT
    return (
        f'max(jetserve_queue_depth{{cls="{cls}"}}) + '
        f'(max(jetserve_pool_queue_depth{{cls="{cls}",deployment="{dep}"}}) or vector(0)) + '
        f'(sum(jetserve_gateway_fair_waiting{{cls=~"{cls}|{cls}@{dep}"}}) or vector(0))'
    )


def test_one_scaled_object_per_class_on_jetserves_consumers() -> None:
    topo = DEFAULT_TOPOLOGY
    consumers = {topo.consumer_name(cls): cls for cls in topo.classes}
    scaled = _of_kind("ScaledObject")
    seen: list[RequestClass] = []
    for name, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1", name
        spec = so["spec"]
        # The whole lag first (Prometheus), the plain consumer's lag as a floor.
        assert [t["type"] for t in spec["triggers"]] == ["prometheus", "nats-jetstream"], name
        trigger = _trigger(so, "nats-jetstream")
        meta = trigger["metadata"]
        # KEDA's trigger metadata is a map of strings: a bare number fails to apply.
        for t in spec["triggers"]:
            assert all(isinstance(v, str) for v in t["metadata"].values()), (name, t)
        assert meta["stream"] == topo.stream, name
        assert meta["consumer"] in consumers, f"{name}: jetserve creates no {meta['consumer']}"
        cls = consumers[meta["consumer"]]
        seen.append(cls)
        prom = _trigger(so, "prometheus")["metadata"]
        assert prom["query"] == keda_lag_query(cls.value), name
        names = _metric_names(prom["query"])
        assert names == {
            "jetserve_queue_depth",
            "jetserve_pool_queue_depth",
            "jetserve_gateway_fair_waiting",
        }, name
        for metric in names:
            assert "cls" in KNOWN_SERIES[metric], f"{metric} has no cls label"
        assert prom["threshold"] == meta["lagThreshold"], name
        assert prom["activationThreshold"] == meta["activationLagThreshold"], name
        assert prom["serverAddress"].startswith("http"), name

        # It scales a Deployment defined here, whose worker serves exactly that class.
        ref = spec["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment", name
        assert ref.get("apiVersion", "apps/v1") == "apps/v1", name
        target = OBJECTS.get(("Deployment", ref["name"]))
        assert target is not None, f"{name}: no Deployment {ref['name']} in deploy/"
        assert "replicas" not in target["spec"], f"{ref['name']}: KEDA owns its replicas"
        _, worker = _container(ref["name"], "worker")
        assert split_csv(worker.classes) == (cls.value,), name
        assert int(meta["lagThreshold"]) == worker.max_inflight, name
        assert int(meta["activationLagThreshold"]) >= 0, name

        low, high = spec["minReplicaCount"], spec["maxReplicaCount"]
        assert 0 <= low <= high, name
        assert high >= 1, name
        if cls is RequestClass.INTERACTIVE:
            assert low >= 1, "interactive requests must not wait for a cold start"

        # KEDA's operator reads /jsz from its own namespace: a full Service name.
        host, _, port = meta["natsServerMonitoringEndpoint"].partition(":")
        assert host.endswith(".svc.cluster.local"), name
        _service_port(host, int(port))
        assert meta.get("account", "$G") == "$G", name
    assert sorted(seen) == sorted(DEFAULT_TOPOLOGY.classes), "one ScaledObject per class"
    assert _of_kind("ScaledObject")["worker-batch"]["spec"]["minReplicaCount"] == 0


def test_kustomize_renders_when_kubectl_is_installed() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize rendering is not checked")
    proc = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    # nats-config's name carries a hash of deploy/nats.conf (a change rolls nats).
    (nats_config,) = [d for d in docs if d["metadata"]["name"].startswith("nats-config-")]
    assert nats_config["data"] == {"nats.conf": NATS_CONF.read_text()}
    rendered = {(d["kind"], d["metadata"]["name"]) for d in docs if d is not nats_config}
    assert rendered == set(OBJECTS) | {("ConfigMap", "jetserve-grafana-dashboard")}
    (nats_set,) = [
        d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats"
    ]
    volumes = {v["name"]: v for v in _pod_spec(nats_set)["volumes"]}
    assert volumes["config"]["configMap"]["name"] == nats_config["metadata"]["name"]


# -- the Grafana dashboard ----------------------------------------------------------


def _families(metrics: object) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Family name -> (type, label names) of a metrics holder's collectors."""
    out = {}
    for value in vars(metrics).values():
        name = getattr(value, "_name", None)
        if isinstance(name, str) and hasattr(value, "_labelnames"):
            out[name] = (value._type, tuple(value._labelnames))
    return out


def _series(families: dict[str, tuple[str, tuple[str, ...]]]) -> dict[str, set[str]]:
    """Exposed series name -> its label names (histograms add ``le`` to _bucket)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
    }
    out: dict[str, set[str]] = {}
    for name, (kind, labels) in families.items():
        for suffix in suffixes[kind]:
            extra = {"le"} if suffix == "_bucket" else set()
            out[name + suffix] = {*labels, *extra, *TARGET_LABELS}
    return out


KNOWN_SERIES = _series({**_families(GatewayMetrics()), **WORKER_METRICS})

_PROMQL_WORDS = {
    # aggregations, functions and keywords the dashboard may use
    *("sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev"),
    *("rate", "irate", "increase", "delta", "histogram_quantile", "clamp", "clamp_min"),
    "clamp_max",
    *("ceil", "floor", "round", "abs", "vector", "scalar", "time", "label_replace"),
    *("by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"),
    *("and", "or", "unless", "sort", "sort_desc"),
    *("avg_over_time", "max_over_time", "min_over_time", "sum_over_time"),
}


def _metric_names(expr: str) -> set[str]:
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\$\{\w+[^}]*\}|\$\w+", "", s)  # dashboard variables
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    s = re.sub(r"(?<![\w.])\d+(\.\d+)?([eE][+-]?\d+)?", "", s)  # numbers
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", s) if w not in _PROMQL_WORDS}


def _label_names(expr: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", re.sub(r"\$\{[^}]*\}", "", expr)):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    return labels


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_promql_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (cls, le) (rate(x_bucket{cls=~"$cls"}[$__rate_interval])))'
        ' / on (cls) group_left max(y_total{reason="a b"}) > 1e3'
    )
    assert _metric_names(expr) == {"x_bucket", "y_total"}
    assert _label_names(expr) == {"cls", "le", "reason"}


def test_dashboard_queries_only_known_metrics_and_labels(dashboard: dict[str, Any]) -> None:
    exprs = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            assert target.get("expr"), f"panel {panel['title']!r}: a target without expr"
            exprs.append((panel["title"], target["expr"]))
    assert len(exprs) >= 15
    for title, expr in exprs:
        names = _metric_names(expr)
        assert names, f"{title!r}: no metric in {expr!r}"
        unknown = names - KNOWN_SERIES.keys()
        assert not unknown, f"{title!r}: unknown metrics {sorted(unknown)} in {expr!r}"
        labels = set().union(*(KNOWN_SERIES[n] for n in names))
        assert _label_names(expr) <= labels, f"{title!r}: unknown labels in {expr!r}"
    for var in dashboard["templating"]["list"]:
        query = var.get("definition") or ""
        for metric, label in re.findall(r"label_values\((\w+),\s*(\w+)\)", query):
            assert label in KNOWN_SERIES[metric], var["name"]


def test_dashboard_covers_the_issue(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(t["expr"] for p in _panels(dashboard) for t in p.get("targets", []))
    for needed in (
        "jetserve_gateway_requests_total",  # traffic by class
        "jetserve_gateway_time_to_first_token_seconds_bucket",  # TTFT percentiles
        "jetserve_gateway_request_duration_seconds_bucket",  # e2e percentiles
        "jetserve_gateway_time_per_output_token_seconds_bucket",  # TPOT percentiles
        "jetserve_queue_depth",  # queue lag
        "jetserve_gateway_rejected_total",  # rejections, budget denials
        "jetserve_gateway_tokens_total",
        "jetserve_gateway_inflight",
        "jetserve_worker_kv_headroom_ratio",  # KV headroom
    ):
        assert needed in exprs, needed
    assert "budget_exceeded" in exprs
    assert "histogram_quantile" in exprs


def test_dashboard_desired_workers_use_the_scaled_objects(dashboard: dict[str, Any]) -> None:
    """The "desired workers" panel spells KEDA's formula with keda.yaml's numbers."""
    (panel,) = [p for p in _panels(dashboard) if p["title"].startswith("Desired workers")]
    exprs = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
    scaled = _of_kind("ScaledObject")
    assert len(exprs) == len(scaled)
    for so in scaled.values():
        meta = _trigger(so, "nats-jetstream")["metadata"]
        cls = meta["consumer"].removeprefix("workers-")
        lag = f"({keda_lag_query(cls)})"
        low, high = so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]
        # With activationLagThreshold 0, KEDA's 0 <-> 1 step is the clamp at `low`.
        assert meta["activationLagThreshold"] == "0"
        want = f"clamp(ceil({lag} / {meta['lagThreshold']}), {low}, {high})"
        assert exprs[cls] == want


def test_dashboard_is_importable(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dashboard["uid"]
    assert dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_worker_metric_list_is_current() -> None:
    """WORKER_METRICS (above) against the worker's own metrics (imported: a
    renamed module fails here, not skips)."""
    actual = _families(WorkerMetrics())
    for name, spec in WORKER_METRICS.items():
        assert actual.get(name) == spec, f"{name}: documented {spec}, worker has {actual.get(name)}"


# -- `jetserve scale`: KEDA's arithmetic, checked against the ScaledObjects --------


def _policy(so: dict[str, Any], max_inflight: int, current: int | None = None) -> Policy:
    meta = _trigger(so, "nats-jetstream")["metadata"]
    return Policy(
        max_inflight=max_inflight,
        lag_threshold=int(meta["lagThreshold"]),
        activation_lag_threshold=int(meta["activationLagThreshold"]),
        min_replicas=so["spec"]["minReplicaCount"],
        max_replicas=so["spec"]["maxReplicaCount"],
        current_replicas=current,
    )


@pytest.mark.parametrize(
    ("lag", "policy", "desired", "active"),
    [
        (0, Policy(16, 16, 0, 0, 8), 0, False),  # idle, may scale to zero
        (1, Policy(16, 16, 0, 0, 8), 1, True),  # one request wakes it
        (5, Policy(16, 16, 5, 0, 8), 0, False),  # not above activationLagThreshold
        (6, Policy(16, 16, 5, 0, 8), 1, True),
        (5, Policy(4, 1, 5, 2, 8), 5, False),  # min >= 1: the HPA runs, active or not
        (0, Policy(16, 16, 0, 1, 8), 1, False),  # floor: minReplicaCount
        (40, Policy(16, 16, 0, 1, 8), 3, True),  # ceil(40 / 16)
        (48, Policy(16, 16, 0, 1, 8), 3, True),
        (49, Policy(16, 16, 0, 1, 8), 4, True),
        (1000, Policy(16, 16, 0, 1, 8), 8, True),  # ceiling: maxReplicaCount
        (50, Policy(16, 10, 0, 1, 8, current_replicas=5), 5, True),  # ratio 1.0: keep
        (54, Policy(16, 10, 0, 1, 8, current_replicas=5), 5, True),  # 1.08: within 10 %
        (56, Policy(16, 10, 0, 1, 8, current_replicas=5), 6, True),  # 1.12: ceil(5.6)
        (44, Policy(16, 10, 0, 1, 8, current_replicas=5), 5, True),  # 0.88: ceil(4.4)
        (20, Policy(16, 10, 0, 1, 8, current_replicas=0), 2, True),  # from zero: no tolerance
    ],
)
def test_desired_replicas(lag: int, policy: Policy, desired: int, active: bool) -> None:
    got, is_active, why = desired_replicas(lag, policy)
    assert (got, is_active) == (desired, active), why
    assert str(desired) in why


def test_scale_matches_the_scaled_objects() -> None:
    """What `jetserve scale` computes for deploy/'s own ScaledObjects."""
    for name, so in _of_kind("ScaledObject").items():
        _, worker = _container(so["spec"]["scaleTargetRef"]["name"], "worker")
        pol = _policy(so, worker.max_inflight)
        low, high = pol.min_replicas, pol.max_replicas
        assert desired_replicas(0, pol)[0] == low, name
        # Each max-inflight requests waiting add one worker, up to the maximum.
        for workers in range(max(low, 1), high + 1):
            assert desired_replicas(workers * worker.max_inflight, pol)[0] == workers, name
        assert desired_replicas(10**6, pol)[0] == high, name


def test_per_class_option_values() -> None:
    classes = ("interactive", "embed", "batch")
    assert per_class([], 16, classes, "--x") == dict.fromkeys(classes, 16)
    assert per_class(["0,interactive=1"], None, classes, "--x") == {
        "interactive": 1,
        "embed": 0,
        "batch": 0,
    }
    # Repeatable; a later bare N resets every class.
    assert per_class(["batch=3", "embed=2"], 1, classes, "--x") == {
        "interactive": 1,
        "embed": 2,
        "batch": 3,
    }
    assert per_class(["batch=3", "7"], 1, classes, "--x") == dict.fromkeys(classes, 7)
    for bad in ("chat=1", "batch=-1", "batch=x", "x"):
        with pytest.raises(OptionError):
            per_class([bad], 1, classes, "--x")


def _jsz(consumers: list[dict[str, Any]], last_seq: int = 9) -> dict[str, Any]:
    stream = {
        "name": DEFAULT_TOPOLOGY.stream,
        "state": {"messages": 3, "last_seq": last_seq},
        "consumer_detail": consumers,
    }
    return {"account_details": [{"name": "$G", "stream_detail": [stream]}]}


def test_jsz_is_read_as_keda_reads_it() -> None:
    topo, classes = DEFAULT_TOPOLOGY, ("interactive", "batch")
    doc = _jsz(
        [
            {"name": "workers-interactive", "num_pending": 5, "num_ack_pending": 2},
            {"name": "workers-embed", "num_pending": 100, "num_ack_pending": 0},
        ]
    )
    interactive, batch = lags_from_jsz(doc, "$G", topo, classes)
    assert (interactive.consumer, interactive.lag, interactive.found) == (
        "workers-interactive",
        7,
        True,
    )
    # A consumer KEDA cannot find reads as the stream's last sequence number.
    assert (batch.consumer, batch.found, batch.lag) == ("workers-batch", False, 9)
    with pytest.raises(ScaleError):
        lags_from_jsz(doc, "OTHER", topo, classes)
    with pytest.raises(ScaleError):
        lags_from_jsz({"account_details": []}, "$G", topo, classes)
    assert jsz_url("nats.jetserve.svc.cluster.local:8222", "$G") == (
        "http://nats.jetserve.svc.cluster.local:8222/jsz?acc=$G&consumers=true&config=true"
    )
    assert jsz_url("https://nats:8222/", "A").startswith("https://nats:8222/jsz?acc=A&")


def test_jsz_of_a_fleet_with_a_stream_per_class() -> None:
    """`--class-streams`: each class's consumer is read from its own stream, and
    a consumer missing there reads as that stream's last sequence."""
    split = DEFAULT_TOPOLOGY.split(True)
    streams = [
        {
            "name": split.stream_of("interactive"),
            "state": {"last_seq": 40},
            "consumer_detail": [
                {"name": "workers-interactive", "num_pending": 4, "num_ack_pending": 1}
            ],
        },
        {"name": split.stream_of("batch"), "state": {"last_seq": 12}, "consumer_detail": []},
    ]
    doc = {"account_details": [{"name": "$G", "stream_detail": streams}]}
    interactive, batch = lags_from_jsz(doc, "$G", DEFAULT_TOPOLOGY, ("interactive", "batch"))
    assert (interactive.lag, interactive.found) == (5, True)
    assert (batch.found, batch.lag) == (False, 12)


@pytest.mark.parametrize("shards", [1, 4])
def test_class_streams_split_every_subject_by_class(shards: int) -> None:
    """Each class stream (and lane shard) takes exactly its share of the
    subjects (plain, lanes, excess, pools): no subject is stored by two streams,
    and every consumer's filter is stored by the stream it lives in."""
    split = DEFAULT_TOPOLOGY.split(True, shards)
    assert DEFAULT_TOPOLOGY.request_streams == (DEFAULT_TOPOLOGY.stream,)
    assert len(split.request_streams) == len(RequestClass) + 2 * (shards - 1)
    configs = {n: split.stream_config(n) for n in split.request_streams}
    subjects = [s for cfg in configs.values() for s in cfg.subjects or []]
    assert len(subjects) == len(set(subjects))
    for name, cfg in configs.items():
        assert all(".interactive" in s for s in cfg.subjects or []) == ("INTERACTIVE" in name)
        assert cfg.metadata is not None
        assert cfg.metadata["jetserve_class_streams"] == "1"
    pool = pool_consumer_configs(split, "tok")
    lanes = [split.lane_consumer_config(c, n) for c in split.lane_classes for n in range(256)]
    for want in [*lanes, *pool]:
        stream = configs[split.stream_of_consumer(want["durable_name"])]
        assert covers(stream.subjects or [], want["filter_subject"]), want
    for cls in RequestClass:
        plain = split.consumer_config(cls).filter_subject or ""
        assert covers(configs[split.stream_of(cls)].subjects or [], plain)
    recorded = DEFAULT_TOPOLOGY.with_stream_lanes(split.lane_metadata())
    assert (recorded.class_streams, recorded.lane_shards) == (True, shards)
    with pytest.raises(ValueError, match="not a work-queue stream"):
        split.stream_config(DEFAULT_TOPOLOGY.stream)
    with pytest.raises(ValueError, match="need class_streams"):
        DEFAULT_TOPOLOGY.split(False, 2)


def covers(subjects: list[str], subject: str) -> bool:
    """Whether a stream with ``subjects`` stores ``subject`` (NATS wildcards)."""

    def match(pattern: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        if p[-1] == ">":
            return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s, strict=False))
        return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s, strict=True))

    return any(match(x) for x in subjects)


def test_scale_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert jetserve_cli.main(["scale", "--min-replicas", "chat=1"]) == 2
    assert "unknown class 'chat'" in capsys.readouterr().err
    assert jetserve_cli.main(["scale", "--min-replicas", "3", "--max-replicas", "2"]) == 2
    assert jetserve_cli.main(["scale", "--classes", "interactive,chat"]) == 2
    # No operator credential in the environment: refused before connecting.
    assert jetserve_cli.main(["scale", "--nats", "nats://127.0.0.1:1"]) == 2
    assert "JETSERVE_NATS_SEED_FILE" in capsys.readouterr().err
    # Nothing listens on port 1: an error and status 1, not a hang.
    assert jetserve_cli.main(["scale", "--insecure", "--nats", "nats://127.0.0.1:1"]) == 1
    assert "cannot connect to NATS" in capsys.readouterr().err


def test_every_tenants_service_secret_has_a_kubernetes_name(tmp_path: Path) -> None:
    """Tenant ids allow upper case and ``_``; a Secret's name does not: tenant
    ``Acme_EU``'s Secret was refused by kubectl, its service credential never
    deployed. Two tenants that differ only in case get two Secrets."""
    creds = generate(tmp_path / "creds", ("demo", "Acme_EU", "acme-eu", "ACME-EU"))
    docs = [json.loads(text) for text in k8s_secrets(creds, NAMESPACE).split("\n---\n")]
    services = {
        d["metadata"]["annotations"]["jetserve.dev/tenant"]: d["metadata"]["name"]
        for d in docs
        if "annotations" in d["metadata"]
    }
    assert set(services) == {"demo", "Acme_EU", "acme-eu", "ACME-EU"}
    assert services["demo"] == "jetserve-service-demo"  # a Kubernetes name: as it was
    assert services["acme-eu"] == "jetserve-service-acme-eu"
    assert len(set(services.values())) == 4
    for name in services.values():
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
        assert len(name) <= 253

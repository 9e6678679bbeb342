"""Shared fixtures: real nats-server / redis-server processes on free ports, and
whole fleets (simulator, gateway, workers) as real processes."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from jetserve.credentials import generate
from jetserve.fleet import Fleet, FleetSpec
from jetserve.services import (
    Service,
    confine_ports,
    start_nats,
    start_redis,
    start_redis_cluster,
)
from tests.refusals import assert_no_refusals

_DESELECTED = pytest.StashKey[dict[str, int]]()
_FLEETS = pytest.StashKey[list[Fleet]]()
# A test (or a module) that failed keeps its fleets' directories (logs, stores).
_FAILED = pytest.StashKey[bool]()
# The last lines of each process's log attached to a failing test's report: a
# fleet's processes log to files, and a flake in CI must explain itself.
_LOG_TAIL_LINES = 60

# Opt-in tiers: deselected unless ``-m`` names them (or their environment is
# set), and said so in the summary, never skipped silently.
_TIERS = {
    "vllm": (
        ("JETSERVE_VLLM_URL", "JETSERVE_VLLM_PEERS"),
        "opt-in: bench/peers/vllm.sh, or -m vllm with JETSERVE_VLLM_URL or "
        "JETSERVE_VLLM_PEERS; docs/vllm.md",
    ),
    "llamacpp": (
        ("JETSERVE_LLAMACPP_URL", "JETSERVE_LLAMACPP_PEERS"),
        "opt-in: bench/peers/llamacpp.sh, or -m llamacpp with JETSERVE_LLAMACPP_URL or "
        "JETSERVE_LLAMACPP_PEERS; docs/adapters.md",
    ),
    "open_bug": (
        (),
        "scenarios that found a bug not fixed yet, each naming it; run with -m open_bug",
    ),
}


def pytest_configure(config: pytest.Config) -> None:
    # `make test` runs the suite in parallel processes (pytest-xdist): each picks
    # the ports of the services it starts from a share of its own.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        confine_ports(int(worker[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real-engine tiers (markers `vllm`, docs/vllm.md, and `llamacpp`,
    docs/adapters.md) and the `open_bug` tier are opt-in: each runs only with `-m`
    naming it (or, for an engine, with its JETSERVE_*_URL / JETSERVE_*_PEERS set);
    otherwise its tests are deselected, and said so, never skipped silently."""
    markexpr = config.getoption("markexpr") or ""
    counts: dict[str, int] = {}
    for tier, (env, _) in _TIERS.items():
        if tier in markexpr or any(os.environ.get(v) for v in env):
            continue
        out = [i for i in items if i.get_closest_marker(tier) is not None]
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [i for i in items if i.get_closest_marker(tier) is None]
            counts[tier] = len(out)
    config.stash[_DESELECTED] = counts
    # A parallel run hands tests out by node id: of items sharing one, it runs
    # one and drops the rest without a word (test_openapi_fuzz.py says how).
    twice = sorted(n for n, k in Counter(i.nodeid for i in items).items() if k > 1)
    if twice:
        raise pytest.UsageError(f"tests that share a node id (one would run): {twice}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A parallel worker's deselections, for the summary the controller prints.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["deselected"] = session.config.stash.get(_DESELECTED, {})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's controller collects nothing itself: it takes the workers'
    deselections (each collected the same tests)."""
    counts = getattr(node, "workeroutput", {}).get("deselected")
    if counts is not None:
        node.config.stash[_DESELECTED] = counts


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for tier, n in terminalreporter.config.stash.get(_DESELECTED, {}).items():
        terminalreporter.write_line(f"{tier} tier: {n} tests deselected ({_TIERS[tier][1]})")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
        if (module := item.getparent(pytest.Module)) is not None:
            module.stash[_FAILED] = True
    if report.failed and call.when == "call":
        module = item.getparent(pytest.Module)
        fleets = [*item.stash.get(_FLEETS, []), *(module.stash.get(_FLEETS, []) if module else [])]
        for i, f in enumerate(fleets):
            for name, tail in f.log_tails(_LOG_TAIL_LINES):
                report.sections.append((f"fleet {i} {name}.log (last lines)", tail))
    return report


@pytest.fixture
def nats_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    """A nats-server with the generated authorization (every role, tenant "demo"):
    connect with ``nats_server.bus_auth(role)``."""
    creds = generate(tmp_path / "nats-creds", ("demo",))
    svc = start_nats(tmp_path / "nats", auth_conf=creds.nats_conf)
    svc.creds = creds
    yield svc
    svc.kill()  # its store is this test's temp dir: a clean stop writes it out for nobody
    assert_no_refusals(request, svc.violations())


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Service]:
    """A redis-server with one ACL user per role: ``redis_server.redis_url(user)``."""
    creds = generate(tmp_path / "redis-creds")
    svc = start_redis(tmp_path / "redis", acl=creds.redis_acl)
    svc.creds = creds
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Service]]:
    """A Redis Cluster of 3 primaries with one ACL user per role, every slot
    assigned (``node.redis_url(user)`` of any node seeds a cluster client)."""
    workdir = tmp_path_factory.mktemp("redis-cluster")
    nodes = start_redis_cluster(workdir, 3, creds=generate(workdir / "creds"))
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """One fleet shared by a module's read-only tests: fast simulator, 2 workers."""
    f = Fleet(FleetSpec(workers=2, profile="fast")).start()
    request.node.stash[_FLEETS] = [f]
    yield f
    f.stop(keep=request.node.stash.get(_FAILED, False))
    assert_no_refusals(request, f.violations())


@pytest.fixture
def make_fleet(request: pytest.FixtureRequest) -> Iterator[Callable[..., Fleet]]:
    """Fleets a test may break (kill workers, stop services): torn down after it."""
    made: list[Fleet] = []
    request.node.stash[_FLEETS] = made

    def make(**kwargs: object) -> Fleet:
        f = Fleet(FleetSpec(**kwargs))  # type: ignore[arg-type]
        made.append(f)
        return f.start()

    yield make
    for f in made:
        f.stop(keep=request.node.stash.get(_FAILED, False))
    assert_no_refusals(request, [line for f in made for line in f.violations()])

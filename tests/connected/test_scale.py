"""`jetserve scale` against real servers: the lag it reports is what was queued, its
desired worker counts follow KEDA's formula, and it reads the same numbers through
the JetStream API as KEDA reads from the monitoring endpoint (/jsz)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from jetserve.credentials import generate
from jetserve.fleet import Fleet
from jetserve.services import free_port, start_nats, wait_port
from streams.auth import Role
from streams.connect import BusAuth, connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.provision import ensure_topology
from streams.subjects import RequestClass, request_subject
from tests.scrape import promtool
from tests.waits import until

pytestmark = pytest.mark.connected

TOPO = DEFAULT_TOPOLOGY


def scale(*args: str) -> dict[str, dict[str, Any]]:
    """Run `jetserve scale --json` as an operator would; its rows by class."""
    proc = subprocess.run(
        [sys.executable, "-m", "jetserve", "scale", "--json", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["stream"] == TOPO.stream
    assert "ceil(lag / lagThreshold)" in report["formula"]
    return {row["class"]: row for row in report["classes"]}


async def wait_lag(
    nats_url: str, auth: BusAuth, want: dict[RequestClass, int], limit_s: float = 10.0
) -> None:
    nc = await connect(nats_url, "test-scale", auth)
    try:
        js = nc.jetstream()
        end = time.monotonic() + limit_s
        while True:
            got = {}
            for cls in want:
                info = await js.consumer_info(TOPO.stream, TOPO.consumer_name(cls))
                got[cls] = (info.num_pending or 0) + (info.num_ack_pending or 0)
            if got == want:
                return
            assert time.monotonic() < end, f"lag {got}, expected {want}"
            await asyncio.sleep(0.05)
    finally:
        await nc.close()


async def test_scale_reports_the_queued_lag_and_keda_replicas(
    make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = make_fleet(workers=0)  # nothing consumes: every request waits in the queue
    assert fleet.creds is not None  # `jetserve scale` runs as the operator
    monkeypatch.setenv("JETSERVE_NATS_SEED_FILE", str(fleet.creds.seed_file(Role.ADMIN)))
    queued = {RequestClass.INTERACTIVE: 7, RequestClass.BATCH: 5, RequestClass.EMBED: 0}
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "45"}

    async def call(c: httpx.AsyncClient, cls: RequestClass, i: int) -> int:
        body = {
            "model": "sim-8b",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": f"{cls} request {i}"}],
        }
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=body,
            headers={**headers, "X-Jetserve-Class": cls.value},
        )
        return r.status_code

    async with httpx.AsyncClient(timeout=60) as c:
        calls = [
            asyncio.create_task(call(c, cls, i)) for cls, n in queued.items() for i in range(n)
        ]
        await wait_lag(fleet.nats_url, fleet.bus_auth(), queued)

        policy = (
            "--max-inflight",
            "3",
            "--min-replicas",
            "0,interactive=1",
            "--max-replicas",
            "10",
            "--activation-lag",
            "batch=5",
        )
        rows = await asyncio.to_thread(scale, "--nats", fleet.nats_url, *policy)
        for cls, n in queued.items():
            row = rows[cls.value]
            assert row["consumer"] == TOPO.consumer_name(cls)
            assert row["consumer_found"] is True
            assert row["lag"] == row["num_pending"] + row["num_ack_pending"] == n
            assert row["num_ack_pending"] == 0  # no worker has fetched anything
            assert row["max_inflight"] == row["lag_threshold"] == 3
        # interactive: active, ceil(7 / 3) = 3 within [1, 10].
        assert rows["interactive"]["active"] is True
        assert rows["interactive"]["desired_replicas"] == math.ceil(7 / 3) == 3
        # batch: lag 5 is not above activationLagThreshold 5, min 0: stays at zero.
        assert rows["batch"]["active"] is False
        assert rows["batch"]["desired_replicas"] == 0
        # embed: nothing queued, min 0.
        assert rows["embed"]["desired_replicas"] == 0

        # A lower activation threshold wakes batch: ceil(5 / 2) = 3; max caps interactive.
        rows = await asyncio.to_thread(
            scale,
            "--nats",
            fleet.nats_url,
            "--target-per-worker",
            "2",
            "--max-replicas",
            "3,interactive=2",
            "--activation-lag",
            "batch=4",
        )
        assert rows["batch"]["active"] is True
        assert rows["batch"]["desired_replicas"] == 3
        assert rows["batch"]["max_inflight"] == 16  # the worker's default concurrency
        assert rows["interactive"]["desired_replicas"] == 2  # ceil(7 / 2) = 4, capped
        assert rows["embed"]["desired_replicas"] == 0

        # Workers arrive: the queue drains and every request is answered.
        await asyncio.to_thread(fleet.start_worker, wait=False)
        statuses = await asyncio.gather(*calls)
    assert statuses == [200] * sum(queued.values())
    await wait_lag(fleet.nats_url, fleet.bus_auth(), dict.fromkeys(queued, 0))
    rows = await asyncio.to_thread(scale, "--nats", fleet.nats_url, *policy)
    assert {cls: row["lag"] for cls, row in rows.items()} == dict.fromkeys(rows, 0)
    assert rows["interactive"]["desired_replicas"] == 1  # minReplicaCount
    assert rows["batch"]["desired_replicas"] == rows["embed"]["desired_replicas"] == 0


@pytest.fixture
def monitored_nats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, int, BusAuth]]:
    """A nats-server with its monitoring port on, with the generated authorization:
    (client URL, monitoring port, the admin credential). `jetserve scale` runs as
    the operator: the admin seed file in its environment."""
    creds = generate(tmp_path / "creds")
    monitor = free_port()
    server = start_nats(tmp_path / "nats", cluster=["-m", str(monitor)], auth_conf=creds.nats_conf)
    server.creds = creds
    monkeypatch.setenv("JETSERVE_NATS_SEED_FILE", str(creds.seed_file(Role.ADMIN)))
    try:
        wait_port(monitor, 10.0, server.proc)
        yield f"nats://127.0.0.1:{server.port}", monitor, server.bus_auth()
    finally:
        server.kill()  # a temp store: a clean stop writes its consumers out for nobody


def watch_lines(url: str, n: int) -> list[str]:
    """The first n lines of `jetserve scale --json --watch 0.2`."""
    argv = [sys.executable, "-m", "jetserve", "scale", "--json", "--watch", "0.2", "--nats", url]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as watch:
        try:
            assert watch.stdout is not None
            return [watch.stdout.readline() for _ in range(n)]
        finally:
            watch.terminate()


async def test_jetstream_api_and_monitoring_endpoint_agree(
    monitored_nats: tuple[str, int, BusAuth],
) -> None:
    """KEDA reads /jsz; `jetserve scale --monitoring` reads it the same way, and
    `--nats` (the JetStream API) gives the same numbers, ack_pending included."""
    url, monitor, auth = monitored_nats
    nc = await connect(url, "test-scale", auth)
    try:
        js = nc.jetstream()
        await ensure_topology(js, TOPO)
        for i in range(6):
            await js.publish(request_subject(RequestClass.BATCH), f"{i}".encode())
        # A worker that fetched two and has not acked them yet: num_ack_pending.
        sub = await js.pull_subscribe_bind(TOPO.consumer_name(RequestClass.BATCH), TOPO.stream)
        assert len(await sub.fetch(2, timeout=2)) == 2

        args = ("--max-inflight", "4", "--min-replicas", "interactive=1")
        via_api = await asyncio.to_thread(scale, "--nats", url, *args)
        via_jsz = await asyncio.to_thread(scale, "--monitoring", f"127.0.0.1:{monitor}", *args)
    finally:
        await nc.close()
    for rows in (via_api, via_jsz):
        batch = rows["batch"]
        assert (batch["num_pending"], batch["num_ack_pending"], batch["lag"]) == (4, 2, 6)
        assert batch["desired_replicas"] == 2  # ceil(6 / 4)
        assert rows["interactive"]["desired_replicas"] == 1
        assert rows["embed"]["desired_replicas"] == 0

    def same(row: dict[str, Any]) -> dict[str, Any]:
        # Pull requests come and go between the two reads.
        return {k: v for k, v in row.items() if k != "num_waiting"}

    assert [same(r) for r in via_api.values()] == [same(r) for r in via_jsz.values()]

    # --watch refreshes: one JSON document per line.
    lines = await asyncio.to_thread(watch_lines, url, 2)
    stamps = [json.loads(line)["time"] for line in lines]
    assert stamps[1] > stamps[0]


def _keda_queries() -> dict[str, str]:
    """Each class's Prometheus query, as deploy/keda.yaml's ScaledObjects hold it."""
    docs = yaml.safe_load_all((Path(__file__).parents[2] / "deploy" / "keda.yaml").read_text())
    out = {}
    for so in docs:
        triggers = {t["type"]: t["metadata"] for t in so["spec"]["triggers"]}
        cls = triggers["nats-jetstream"]["consumer"].removeprefix("workers-")
        out[cls] = triggers["prometheus"]["query"]
    return out


async def test_keda_queries_read_the_whole_lag_a_gateway_exports(
    make_fleet: Callable[..., Fleet], tmp_path: Path
) -> None:
    """deploy/keda.yaml's queries, evaluated by promtool over what a real gateway's
    /metrics says: the class's lag on its plain subject, its affinity lanes and
    its excess, which the nats-jetstream trigger alone (one consumer) undercounts."""
    fleet = make_fleet(workers=0)  # nothing consumes: every request waits in the queue
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "45"}
    system = "You are a careful assistant. " * 20  # long enough for an affinity lane
    plan = [("interactive", True, i) for i in range(5)] + [
        ("interactive", False, 5),
        ("interactive", False, 6),
        ("batch", False, 7),
        ("batch", True, 8),
    ]

    async def call(c: httpx.AsyncClient, cls: str, laned: bool, i: int) -> int:
        messages = [{"role": "system", "content": f"{system} {i}"}] if laned else []
        messages.append({"role": "user", "content": f"request {i}"})
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={"model": "sim-8b", "max_tokens": 4, "messages": messages},
            headers={**headers, "X-Jetserve-Class": cls},
        )
        return r.status_code

    want = {"interactive": 7, "batch": 2, "embed": 0, "agent": 0}
    metrics_url = fleet.gateway_metrics_urls[0]
    async with httpx.AsyncClient(timeout=60) as c:
        calls = [asyncio.create_task(call(c, *p)) for p in plan]

        async def exported() -> dict[str, float]:
            text = (await c.get(metrics_url)).text
            return {
                cls: sum(
                    s.value
                    for fam in text_string_to_metric_families(text)
                    if fam.name == "jetserve_queue_depth"
                    for s in fam.samples
                    if s.labels.get("cls") == cls
                )
                for cls in want
            }

        async def counted() -> bool:
            return await exported() == want

        await until(counted, "the gateway's queue depth counting every queued request")
        # Most of the lag is on lanes: the plain consumers (what one nats-jetstream
        # trigger reads) show 2 and 1; `jetserve scale` adds the lanes in.
        plain = {RequestClass.INTERACTIVE: 2, RequestClass.BATCH: 1}
        await wait_lag(fleet.nats_url, fleet.bus_auth(), plain)
        rows = await asyncio.to_thread(scale_as_admin, fleet)
        assert {cls: row["lag"] for cls, row in rows.items()} == {c: want[c] for c in rows}
        assert set(rows) >= {"interactive", "batch"}

        text = (await c.get(metrics_url)).text
        series = [
            {"series": _series_text(fam.name, s.labels), "values": str(s.value)}
            for fam in text_string_to_metric_families(text)
            if fam.name in ("jetserve_queue_depth", "jetserve_gateway_fair_waiting")
            for s in fam.samples
        ]
        tests = [
            {
                "expr": query,
                "eval_time": "0m",
                "exp_samples": [{"labels": "{}", "value": want[cls]}],
            }
            for cls, query in _keda_queries().items()
        ]
        spec = tmp_path / "keda-queries.yaml"
        spec.write_text(
            yaml.safe_dump(
                {
                    "rule_files": [],
                    "evaluation_interval": "1m",
                    "tests": [
                        {"interval": "1m", "input_series": series, "promql_expr_test": tests}
                    ],
                }
            )
        )
        out = await asyncio.to_thread(
            subprocess.run,
            [promtool(), "test", "rules", str(spec)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert len(tests) == len(want)

        await asyncio.to_thread(fleet.start_worker, wait=False)
        assert await asyncio.gather(*calls) == [200] * len(plan)


def scale_as_admin(fleet: Fleet) -> dict[str, dict[str, Any]]:
    assert fleet.creds is not None
    env_seed = str(fleet.creds.seed_file(Role.ADMIN))
    proc = subprocess.run(
        [sys.executable, "-m", "jetserve", "scale", "--json", "--nats", fleet.nats_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "JETSERVE_NATS_SEED_FILE": env_seed},
    )
    assert proc.returncode == 0, proc.stderr
    return {row["class"]: row for row in json.loads(proc.stdout)["classes"]}


def _series_text(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"

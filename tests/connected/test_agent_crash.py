"""The crash matrix: agent executors SIGKILL themselves at every named point of a
step (``--crash-at POINT:PROBABILITY``) while 250 money-transfer runs go through
a real fleet; dead executors are restarted as they die. Afterwards: no effect
happened twice (nor was even attempted twice), no run was lost, and every run
ended completed, failed with a reason, or ambiguous awaiting reconciliation.

200 runs use ``transfer`` (it has ``reconcile``: a crash between intent and
outcome is settled by asking the bank); 50 use ``transfer_unreconciled`` (no
``reconcile``: the same crash can only end ``ambiguous``, never a blind repeat).

Run with ``-s`` to see the table; ``JETSERVE_CRASH_MATRIX_OUT=FILE`` keeps it as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as redis

from jetserve.fleet import Fleet, FleetSpec
from streams.agent import Run
from streams.agent_store import RunStore
from streams.connect import BusAuth, connect
from tests.refusals import checked_fleet
from workers.agent.crash import POINTS, CrashPoints

pytestmark = pytest.mark.connected

RECONCILED, BLIND = 200, 50
AGENTS = 4
# Per (run, step, call) reaching the point, once. The draw is a hash of the run
# id, and the run ids come from fixed Idempotency-Keys, so which runs die where
# is the same every time: 24 planned kills, 4 to 6 at each point.
PROBABILITY = {
    "model_call": 0.008,
    "after_intent": 0.02,
    "after_effect": 0.02,
    "after_outcome": 0.03,
    "before_ack": 0.01,
}
# Alone the matrix settles in ~12 s; a loaded 2-core CI box has taken 40.
SETTLE_WITHIN_S = 90.0
ARGS = json.dumps({"from": "alice", "to": "bob", "amount": 1})


def _rules() -> list[dict[str, Any]]:
    def call(tool: str) -> dict[str, Any]:
        fn = {"name": tool, "arguments": ARGS}
        return {"tool_calls": [{"id": "call_1", "type": "function", "function": fn}]}

    return [
        {"match": {"last_role": "user", "contains": "CRASHMX-R"}, "response": call("transfer")},
        {
            "match": {"last_role": "user", "contains": "CRASHMX-B"},
            "response": call("transfer_unreconciled"),
        },
        {"match": {"last_role": "tool", "contains": "CRASHMX"}, "response": {"content": "done"}},
    ]


@pytest.fixture(scope="module")
def crash_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("crash") / "crashes.jsonl"


@pytest.fixture(scope="module")
def fleet(crash_log: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    crash_args = [a for p, v in PROBABILITY.items() for a in ("--crash-at", f"{p}:{v}")]
    spec = FleetSpec(
        workers=2,
        agents=AGENTS,
        profile="fast",
        agent_args=[
            *crash_args,
            "--crash-log",
            str(crash_log),
            "--lease",
            "1.5",
            "--ack-wait",
            "1",
        ],
    )
    with checked_fleet(request, spec) as f:
        yield f


async def _statuses(nats_url: str, auth: BusAuth, ids: list[str]) -> dict[str, Run]:
    nc = await connect(nats_url, "crash-matrix-probe", auth)
    try:
        store = await RunStore.open(nc)
        out: dict[str, Run] = {}
        for run_id in ids:
            stored = await store.get(run_id)
            if stored is not None:
                out[run_id] = stored.run
        return out
    finally:
        await nc.close()


async def _create(client: httpx.AsyncClient, n: int, marker: str, tool: str) -> list[str]:
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> str:
        async with sem:
            r = await client.post(
                "/v1/runs",
                headers={"Idempotency-Key": f"crashmx-{marker[-1]}-{i}"},
                json={
                    "model": "sim-8b",
                    "messages": [{"role": "user", "content": f"{marker} {i}: send 1 to bob"}],
                    "tools": [tool],
                    "timeout": 300,
                },
            )
            assert r.status_code == 201, r.text
            run_id: str = r.json()["id"]
            return run_id

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _supervise(fleet: Fleet, reaped: set[int]) -> int:
    """Restart executors that killed themselves; how many were restarted."""
    dead = [a for a in fleet.agents if a.proc.poll() is not None and a.proc.pid not in reaped]
    for a in dead:
        reaped.add(a.proc.pid)
        fleet.start_agent(wait=False)
    return len(dead)


async def _matrix(
    fleet: Fleet,
) -> tuple[list[str], list[str], dict[str, Run], int, float, list[Any], list[str]]:
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(base_url=fleet.base_url, headers=headers, timeout=30) as client:
        reconciled, blind = await asyncio.gather(
            _create(client, RECONCILED, "CRASHMX-R", "transfer"),
            _create(client, BLIND, "CRASHMX-B", "transfer_unreconciled"),
        )
    ids = reconciled + blind
    created = time.monotonic()
    restarts = 0
    reaped: set[int] = set()
    runs: dict[str, Run] = {}
    while time.monotonic() - created < SETTLE_WITHIN_S:
        restarts += _supervise(fleet, reaped)
        runs = await _statuses(fleet.nats_url, fleet.bus_auth(), ids)
        if len(runs) == len(ids) and all(r.terminal for r in runs.values()):
            break
        await asyncio.sleep(0.3)
    settled_s = time.monotonic() - created
    # The bank's own books: every applied effect, and every attempt to repeat one.
    bank = redis.Redis.from_url(fleet.redis_url)
    try:
        log = [json.loads(e) for e in await bank.lrange("demobank:{bank}:log", 0, -1)]
        raw = await bank.lrange("demobank:{bank}:repeats", 0, -1)
        repeats = [k.decode() if isinstance(k, bytes) else k for k in raw]
    finally:
        await bank.aclose()
    return reconciled, blind, runs, restarts, settled_s, log, repeats


@pytest.mark.timeout(180)  # the file takes ~30 s; headroom for a loaded machine
def test_crash_matrix(fleet: Fleet, crash_log: Path) -> None:
    started = time.monotonic()
    t0 = time.time()
    httpx.post(f"{fleet.sim_url}/sim/scripts?append=1", json=_rules()).raise_for_status()
    reconciled, blind, runs, restarts, settled_s, log, repeats = asyncio.run(_matrix(fleet))
    ids = reconciled + blind
    effects = Counter(e["key"].split("/")[0] for e in log)
    per_key = Counter(e["key"] for e in log)
    crashes: dict[str, set[str]] = defaultdict(set)
    kills = Counter[str]()
    if crash_log.exists():
        for line in crash_log.read_text().splitlines():
            c = json.loads(line)
            crashes[c["point"]].add(c["run"])
            kills[c["point"]] += 1

    def row(selected: set[str]) -> dict[str, int]:
        statuses = Counter(runs[r].status if r in runs else "missing" for r in selected)
        return {
            "runs": len(selected),
            "completed": statuses["completed"],
            "failed": statuses["failed"],
            "ambiguous": statuses["ambiguous"],
            "duplicated_effects": sum(max(0, effects[r] - 1) for r in selected)
            + sum(1 for k in repeats if k.split("/")[0] in selected),
            "lost": sum(1 for r in selected if r not in runs or not runs[r].terminal),
        }

    draws = CrashPoints(PROBABILITY)
    planned = Counter[str]()
    for run_id in ids:
        for p in POINTS:
            steps = (0, 1) if p in ("model_call", "before_ack") else (0,)
            call = "call_1" if p.startswith("after") else ""
            planned[p] += sum(draws.draw(p, run_id, s, call) for s in steps)
    table = {p: {"planned": planned[p], "kills": kills[p], **row(crashes[p])} for p in POINTS}
    table["all runs"] = {
        "planned": sum(planned.values()),
        "kills": sum(kills.values()),
        **row(set(ids)),
    }
    report = {
        "table": table,
        "runs": len(ids),
        "executor_restarts": restarts,
        "settled_s": round(settled_s, 1),
        "total_s": round(time.monotonic() - started, 1),
    }
    print("\ncrash matrix:", json.dumps(report, indent=1))
    if out := os.environ.get("JETSERVE_CRASH_MATRIX_OUT"):
        Path(out).write_text(json.dumps(report, indent=1) + "\n")

    total = table["all runs"]
    lost = [r for r in ids if r not in runs or not runs[r].terminal]
    assert total["lost"] == 0, [
        (r, "no record")
        if r not in runs
        else (r, runs[r].status, runs[r].step, runs[r].model_call, round(runs[r].updated - t0, 1))
        for r in lost[:5]
    ]
    assert total["duplicated_effects"] == 0, (repeats[:5], per_key.most_common(3))
    assert all(n == 1 for n in per_key.values())
    for p in POINTS:
        assert table[p]["kills"] >= 1, f"no executor died at {p}: the matrix did not cover it"
    for run_id in ids:
        run = runs[run_id]
        assert run.status in ("completed", "failed", "ambiguous"), (run_id, run.status)
        if run.status == "failed":
            assert run.reason, run_id
        if run.status == "completed":
            # The transfer happened exactly once and the model saw its receipt.
            assert effects[run_id] == 1, run_id
            (tool_msg,) = [m for m in run.messages if m["role"] == "tool"]
            assert json.loads(tool_msg["content"])["key"] == f"{run_id}/0/call_1"
        if run.status == "ambiguous":
            assert run_id in blind, "a reconcilable transfer must never end ambiguous"
            assert "awaiting reconciliation" in run.reason
            assert run.ambiguous_key
    for run_id in reconciled:
        assert runs[run_id].status == "completed", (run_id, runs[run_id].reason)

"""The fault suite, agent runs: one node of a 3-node JetStream cluster (every
stream, KV bucket and consumer R3) SIGKILLed while money-transfer runs go
through the gateway, workers and agent executors.

Each run makes a model call (the simulator answers with a ``transfer`` tool
call), runs the tool, and makes a second model call (the final answer). The
runs start at a steady pace; the node dies once half of them have been created,
so runs are in every phase when it does.

Predicted: nothing about a run lives on one node. A step's outcome is durable
(R3) before its message is acked, so a step the kill interrupted is redone by
its redelivery; its effect is asked of the effect ledger and the bank first
(``reconcile``), never blindly repeated; an interrupted model call is retried
under a new request id (``model_attempts``: 3). So every run ends exactly once
(one terminal status, one ledger record), every transfer happens exactly once,
none hangs, and none fails but a run whose deadline came before the cluster
served again (plus its turn in the backlog): deadline_exceeded, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats.errors
import pytest
import redis.asyncio as aioredis
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError

from jetserve.fleet import Fleet
from streams.agent import TERMINAL, Run, decode_event, decode_run, model_request_id
from streams.agent_topology import DEFAULT_AGENT
from streams.definitions import DEFAULT_TOPOLOGY as TOPOLOGY
from streams.subjects import frames_filter
from tests.faults.harness import Window, ledger_rows, tcp_peers
from tests.waits import until_sync

pytestmark = [pytest.mark.connected, pytest.mark.faults, pytest.mark.timeout(180)]

RUNS = 40
KILL_AFTER = 20  # runs created before the node dies
PACE_S = 0.1  # one run created every PACE_S
RUN_TIMEOUT_S = 45.0  # each run's own deadline
# Once the cluster serves again, a run waits its turn behind the others' steps.
BACKLOG_S = 5.0
# A run ends by its deadline at the latest (the executor halts it, a model call
# ends there); past it, plus a redelivery and a lease (2 s each here), it hung.
HUNG_AFTER_S = 15.0
ARGS = json.dumps({"from": "alice", "to": "bob", "amount": 1})


def _not_logs(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".log") and "." in n]


async def _dump(fleet: Fleet, marker: str) -> None:
    """With JETSERVE_FAULTS_DUMP=DIR: every process's log, the agents' with
    their tasks (SIGUSR1) and where each waits, copied to DIR/<marker>."""
    if not (dump := os.environ.get("JETSERVE_FAULTS_DUMP")):
        return
    logs = [fleet.workdir / f"{agent.name}.log" for agent in fleet.agents]
    for agent in fleet.agents:
        agent.signal(signal.SIGUSR1)
    # Each agent's loop writes its dump: until every log has one (a live agent).
    with contextlib.suppress(AssertionError):
        await until_sync(
            lambda: all(" tasks" in p.read_text(errors="replace") for p in logs), "dumps", 5
        )
    shutil.copytree(fleet.workdir, Path(dump) / marker, ignore=_not_logs)


def rules(marker: str) -> list[dict[str, Any]]:
    fn = {"name": "transfer", "arguments": ARGS}
    call = {"tool_calls": [{"id": "call_1", "type": "function", "function": fn}]}
    return [
        {"match": {"last_role": "user", "contains": marker}, "response": call},
        {"match": {"last_role": "tool", "contains": marker}, "response": {"content": "done"}},
    ]


@dataclass
class Created:
    index: int
    run_id: str | None = None  # None: never created
    at: float = 0.0  # time.time() of the create that succeeded
    refusals: list[str] = field(default_factory=list)  # the answers before it was


async def create(client: httpx.AsyncClient, marker: str, i: int) -> Created:
    """Create run ``i`` as a client does: retried under the same Idempotency-Key
    while refused with 503 (retryable) or cut off, so a refused or broken create
    makes no second run. Anything else ends the attempts."""
    out = Created(i)
    end = time.monotonic() + 60.0
    while time.monotonic() < end:
        try:
            r = await client.post(
                "/v1/runs",
                headers={"Idempotency-Key": f"{marker}-{i}"},
                json={
                    "model": "sim-8b",
                    "messages": [{"role": "user", "content": f"{marker} {i}: send 1 to bob"}],
                    "tools": ["transfer"],
                    "timeout": RUN_TIMEOUT_S,
                },
            )
        except httpx.TransportError as exc:
            out.refusals.append(type(exc).__name__)
        else:
            if r.status_code in (200, 201):
                out.run_id = r.json()["id"]
                out.at = time.time()
                return out
            out.refusals.append(f"{r.status_code} {r.json()['error']['code']}")
            if r.status_code != 503:
                return out
        await asyncio.sleep(0.1)  # the client's retry backoff
    return out


async def runs_of(fleet: Fleet, ids: list[str], until_s: float) -> dict[str, Run]:
    """The run records, read until every one is terminal or ``until_s`` passes."""
    nc = await fleet.connect(name="agent-faults-probe")
    try:
        kv = await nc.jetstream().key_value(DEFAULT_AGENT.bucket)
        runs: dict[str, Run] = {}
        while True:
            for run_id in ids:
                if run_id in runs and runs[run_id].terminal:
                    continue
                try:
                    entry = await kv.get(run_id)
                except KeyNotFoundError:
                    continue
                except (nats.errors.Error, TimeoutError):
                    continue  # the bus is electing leaders: read it again
                assert entry.value is not None
                runs[run_id] = decode_run(entry.value)
            if len(runs) == len(ids) and all(r.terminal for r in runs.values()):
                return runs
            if time.time() > until_s:
                return runs
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def terminal_events(fleet: Fleet, tenant: str) -> dict[str, set[tuple[str, int]]]:
    """Per run, the distinct (status, revision) of its terminal status events
    (a replay after a crash repeats an event with its revision)."""
    nc = await fleet.connect(name="agent-faults-events")
    out: dict[str, set[tuple[str, int]]] = defaultdict(set)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(
            f"jetserve.run.{tenant}.>",
            stream=DEFAULT_AGENT.events_stream,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        )
        try:
            while True:
                msg = await sub.next_msg(timeout=30)
                event = decode_event(msg.data)
                if event.kind == "status" and event.status in TERMINAL:
                    out[event.run_id].add((event.status, event.revision))
                if msg.metadata.num_pending == 0:
                    return out
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()


async def ledger_counts(fleet: Fleet, ids: set[str]) -> Counter[str]:
    """Ledger records per run, once every run has one (bounded: the settler
    writes a run's record after its tree ended)."""
    end = time.monotonic() + 30.0
    counts: Counter[str] = Counter()
    while True:
        rows = await ledger_rows(fleet)
        if rows is not None:
            counts = Counter(str(r["request_id"]) for r in rows if str(r["request_id"]) in ids)
        if set(counts) >= ids or time.monotonic() > end:
            return counts
        await asyncio.sleep(0.5)


async def bank_books(fleet: Fleet) -> tuple[list[dict[str, Any]], list[str]]:
    """The demo bank's own books: every applied effect, and every repeat attempt."""
    bank = aioredis.Redis.from_url(fleet.redis_url)
    try:
        log = [json.loads(e) for e in await bank.lrange("demobank:{bank}:log", 0, -1)]
        raw = await bank.lrange("demobank:{bank}:repeats", 0, -1)
        repeats = [k.decode() if isinstance(k, bytes) else str(k) for k in raw]
    finally:
        await bank.aclose()
    return log, repeats


async def hung_report(fleet: Fleet, hung: list[str], runs: dict[str, Run]) -> str:
    """What a hung run's record and the step consumer say (for the failure)."""
    now = time.time()
    lines = []
    for run_id in hung[:5]:
        run = runs.get(run_id)
        if run is None:
            lines.append(f"{run_id}: no record")
            continue
        lines.append(
            f"{run_id}: {run.status} at step {run.step}, updated {now - run.updated:.1f}s ago, "
            f"deadline {run.deadline - now:+.1f}s, model call {run.model_call}, "
            f"{len(run.messages)} messages"
        )
    nc = await fleet.connect(name="agent-faults-diag")
    try:
        info = await nc.jetstream().consumer_info(DEFAULT_AGENT.stream, DEFAULT_AGENT.step_consumer)
        lines.append(
            f"step consumer: pending {info.num_pending}, ack pending {info.num_ack_pending}, "
            f"redelivered {info.num_redelivered}, waiting pulls {info.num_waiting}"
        )
    except (nats.errors.Error, TimeoutError) as exc:
        lines.append(f"step consumer: {exc!r}")
    finally:
        await nc.close()
    return f"{len(hung)} runs hung past their deadline:\n" + "\n".join(lines)


async def frames_report(fleet: Fleet, runs: dict[str, Run], ids: list[str]) -> str:
    """Per failed run, the frames its model calls got in the capture (for the
    failure: did a worker answer a call the executor never read?)."""
    nc = await fleet.connect(name="agent-faults-frames")
    lines = []
    try:
        js = nc.jetstream()
        for run_id in ids[:5]:
            step = runs[run_id].step
            for attempt in (1, 2, 3):
                rid = model_request_id(run_id, step, attempt)
                try:
                    subjects = frames_filter(fleet.spec.tenant, rid)
                    info = await js.stream_info(TOPOLOGY.frames_stream, subjects_filter=subjects)
                except (nats.errors.Error, TimeoutError) as exc:
                    lines.append(f"{rid}: {exc!r}")
                    continue
                if info.state.subjects:
                    lines.append(f"{rid}: frames {dict(info.state.subjects)}")
    finally:
        await nc.close()
    return "\n".join(lines)


def describe(runs: dict[str, Run], ids: list[str], t0: float) -> str:
    """Where each of ``ids`` stood when it ended (times from the test's start)."""
    lines = []
    for run_id in ids[:5]:
        r = runs[run_id]
        lines.append(
            f"{run_id}: {r.status} ({r.reason}) at step {r.step}, created {r.created - t0:+.1f}s, "
            f"updated {r.updated - t0:+.1f}s, model call {r.model_call}, {len(r.messages)} messages"
        )
    return f"{len(ids)} runs did not complete:\n" + "\n".join(lines)


async def test_nats_node_killed_during_agent_runs(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(
        workers=2,
        agents=2,
        nats_nodes=3,
        agent_args=["--lease", "2", "--ack-wait", "2"],
        log_level=os.environ.get("JETSERVE_FAULTS_LOG_LEVEL", "warning"),
    )
    marker = "AGENTFAULT" + uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(timeout=30) as sim:
        r = await sim.post(f"{fleet.sim_url}/sim/scripts?append=1", json=rules(marker))
        r.raise_for_status()
    node = fleet.nats_nodes[1]
    killed: list[Window] = []
    peers: set[str] = set()
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    started = time.monotonic()
    started_at = time.time()
    async with httpx.AsyncClient(base_url=fleet.base_url, headers=headers, timeout=30) as client:
        creating = []
        for i in range(RUNS):
            if i == KILL_AFTER:
                peers.update(tcp_peers([*fleet.gateways, *fleet.workers, *fleet.agents], node.port))
                t0 = time.time()
                node.kill()
                killed.append(Window(t0, time.time()))
            creating.append(asyncio.create_task(create(client, marker, i)))
            await asyncio.sleep(PACE_S)
        created = await asyncio.gather(*creating)
    ids = [c.run_id for c in created if c.run_id is not None]
    refused = Counter(x for c in created for x in c.refusals)
    never = [(c.index, c.refusals) for c in created if c.run_id is None]
    assert len(set(ids)) == len(ids), "one run per Idempotency-Key"
    last_deadline = time.time() + RUN_TIMEOUT_S
    runs = await runs_of(fleet, ids, last_deadline + HUNG_AFTER_S)
    settled_s = time.monotonic() - started
    events = await terminal_events(fleet, fleet.spec.tenant)
    records = await ledger_counts(fleet, set(ids))
    log, repeats = await bank_books(fleet)
    effects = Counter(str(e["key"]) for e in log if str(e["key"]).split("/")[0] in runs)
    statuses = Counter(r.status for r in runs.values())
    print(
        f"\nNATS node SIGKILLed during agent runs: runs {len(ids)} of {RUNS} created, "
        f"statuses {dict(statuses)}, hung {len(ids) - sum(r.terminal for r in runs.values())}, "
        f"effects {sum(effects.values())}, repeats {len(repeats)}, creates refused "
        f"{dict(refused)}, on the node {sorted(peers)}, settled in {settled_s:.1f}s"
    )

    # None hung: each ended by its deadline.
    hung = [i for i in ids if i not in runs or not runs[i].terminal]
    if hung:
        await _dump(fleet, marker)
    assert not hung, await hung_report(fleet, hung, runs)
    # Each ended exactly once: one terminal status (its events agree), one record.
    for run_id, run in runs.items():
        assert len(events[run_id]) == 1, (run_id, run.status, events[run_id])
        assert {s for s, _ in events[run_id]} == {run.status}, (run_id, run.status, events[run_id])
        assert records[run_id] == 1, (run_id, records[run_id])
    # Each transfer happened exactly once, and nobody even tried it twice.
    assert not repeats, repeats[:5]
    assert all(n == 1 for n in effects.values()), effects.most_common(3)
    # The bound on failed runs: nothing about a run lives on one node, so only a
    # run whose deadline came before the cluster served again (the first create
    # that succeeded after the kill: the R3 groups' elections, seconds on a
    # loaded box) plus its turn in the backlog may end deadline_exceeded.
    (kill,) = killed
    recovered = min((c.at for c in created if c.run_id and c.at > kill.end), default=kill.end)
    at_risk = {i for i, r in runs.items() if r.created + RUN_TIMEOUT_S < recovered + BACKLOG_S}
    failed = [i for i, r in runs.items() if r.status != "completed"]
    unpredicted = [i for i in failed if i not in at_risk or runs[i].status != "deadline_exceeded"]
    if unpredicted:
        print("\nframes of failed runs:\n" + await frames_report(fleet, runs, unpredicted))
        await _dump(fleet, marker)
        for path in sorted(fleet.workdir.glob("agent*.log")):
            tail = path.read_text(errors="replace").splitlines()[-15:]
            print(f"\n{path.name}:\n" + "\n".join(tail))
    assert not unpredicted, describe(runs, unpredicted, started_at) + (
        f"; served again {recovered - kill.end:.1f}s after the kill, at risk {len(at_risk)}"
    )
    for run_id, run in runs.items():
        if run.status != "completed":
            continue
        assert effects[f"{run_id}/0/call_1"] == 1, run_id
        (tool_msg,) = [m for m in run.messages if m["role"] == "tool"]
        assert json.loads(tool_msg["content"])["key"] == f"{run_id}/0/call_1"
        assert run.result == "done"
    # Every create refused while the bus was electing leaders (503, retryable)
    # went through on a retry with its Idempotency-Key.
    assert not never, f"runs never created: {never[:5]}"

"""The fault suite: each scenario runs steady streaming load against a real fleet
while a fault is injected, then reconciles what clients saw with the ledger.

Every accepted request must end completed or visibly failed: lost, duplicated
and hung must all be 0. Besides, each scenario names the requests its fault puts
at risk, from what the fleet recorded (each client's own times, the engine's
records, the ledger, the fault's moment), and the codes they may fail or be
refused with; any other visible failure or refusal fails the scenario. So
visibly failed <= |at risk| and completed >= accepted - |at risk|, with the bound
each mechanism predicts. Run alone with ``pytest -m faults -s`` to see the table
(docs/reliability.md#the-fault-suite); ``JETSERVE_FAULTS_DUMP=DIR`` keeps every
outcome as JSON.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable

import pytest

from jetserve.fleet import Fleet
from streams.definitions import DEFAULT_TOPOLOGY
from tests.faults.harness import (
    Load,
    Report,
    Window,
    check,
    connections,
    dump,
    engine_records,
    engine_started_before,
    engine_stats,
    references,
    serving_again,
    tcp_peers,
    worker_id,
)
from tests.fleet_logs import events
from tests.waits import until_sync

pytestmark = [pytest.mark.connected, pytest.mark.faults, pytest.mark.timeout(180)]

# A connection that broke before the response headers: the client has no request
# id (nothing to resume by) and counts it refused.
TRANSPORT_ERRORS = {"RemoteProtocolError", "ReadError", "ConnectError", "WriteError"}
# Refusals while the bus cannot take or deliver work: 503 when a publish fails,
# 429 when the queue stopped moving and the wait ahead exceeds the request's
# deadline (load shedding, docs/routing.md).
STALLED_BUS = {"bus_unavailable", "deadline_unmeetable"}


async def run(
    fleet: Fleet,
    fault: Callable[[], Awaitable[None] | None],
    *,
    duration: float = 10.0,
    context: dict[str, object] | None = None,
    **load: object,
) -> Report:
    refs = await references(fleet)
    driver = Load(fleet, **load)  # type: ignore[arg-type]
    fault_over = asyncio.Event()
    running = asyncio.create_task(driver.run(duration, fault_over))
    try:
        result = fault()
        if result is not None:
            await result
    finally:
        fault_over.set()
    outcomes = await running
    report = await check(fleet, outcomes, refs)
    dump(fault.__name__, report, fleet=str(fleet.workdir), **(context or {}))
    assert report.accepted > 0, report.row(fault.__name__)
    return report


def judged(report: Report, name: str, extra: str = "") -> None:
    """The scenario's own bounds held: now nothing lost, duplicated or hung."""
    print(f"\n{report.row(name)}{extra}")
    report.assert_nothing_lost()


async def test_worker_sigkill_x20(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=3)
    rng = random.Random(3)
    kills: list[tuple[str, Window]] = []

    async def worker_sigkill_x20() -> None:
        await asyncio.sleep(1.0)
        for _ in range(20):
            live = [w for w in fleet.workers if w.proc.poll() is None]
            victim = rng.choice(live)
            t0 = time.time()
            victim.kill()
            kills.append((worker_id(victim), Window(t0, time.time())))
            await asyncio.to_thread(fleet.start_worker, wait=False)
            await asyncio.sleep(0.4)

    report = await run(
        fleet,
        worker_sigkill_x20,
        duration=12.0,
        users=12,
        timeout_s=20.0,
        context={"kills": kills},
    )
    # At risk: the streams a killed worker had started (the engine's first token
    # before the kill) and its client had not seen end by then. A request it
    # held but had not started is redelivered (nothing was emitted) and must
    # complete; a stream that completed on another worker was never on it.
    ids = [o.request_id for o in report.accepted_outcomes() if o.request_id]
    engine = await engine_records(fleet, ids)
    at_risk: set[str] = set()
    for o in report.accepted_outcomes():
        assert o.request_id is not None
        served_by = str(report.records.get(o.request_id, {}).get("worker", ""))
        for wid, kill in kills:
            if not o.open_during(kill):
                continue
            if o.kind == "completed" and served_by and served_by != wid:
                continue
            if engine_started_before(o, engine.get(o.request_id), kill.end):
                at_risk.add(o.request_id)
    report.assert_failures(
        at_risk, {"stream_interrupted"}, "started on a worker when it was SIGKILLed"
    )
    report.assert_rejections(())
    judged(report, "worker SIGKILL x20")


async def test_nats_server_restart(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2)
    outage: list[Window] = []

    async def nats_server_restart() -> None:
        await asyncio.sleep(3.0)
        assert fleet.nats is not None
        t0 = time.time()
        await asyncio.to_thread(fleet.nats.restart)
        outage.append(Window(t0, await serving_again(fleet)))

    report = await run(
        fleet, nats_server_restart, users=10, timeout_s=10.0, context={"outage": outage}
    )
    (down,) = outage
    # At risk: requests in flight from the stop until a request is served end to
    # end again (a frame published meanwhile may be lost, and JETSERVE_FRAMES is
    # in memory: nothing to replay). Sent while the bus is down: refused, 503. A
    # whole answer lost before its first token ends answer_lost (the gateway's
    # queue watch: taken, then silent) rather than at its deadline.
    at_risk = {o.request_id for o in report.accepted_outcomes() if o.open_during(down)}
    report.assert_failures(
        {i for i in at_risk if i},
        {"stream_interrupted", "deadline_exceeded", "answer_lost"},
        "in flight from the stop until served again",
    )
    report.assert_rejections(STALLED_BUS, lambda o: o.open_during(down))
    report.assert_served_after(down.end, "the bus came back")
    judged(report, "nats-server restart", f"; outage {down.end - down.start:.2f}s")


async def test_redis_stop_and_restart(make_fleet: Callable[..., Fleet]) -> None:
    # At info the gateways log each shedding refusal with what it weighed.
    fleet = make_fleet(workers=2, log_level="info")
    outage: list[Window] = []

    async def redis_stopped_3s() -> None:
        await asyncio.sleep(2.5)
        assert fleet.redis is not None
        t0 = time.time()
        await asyncio.to_thread(fleet.redis.stop)
        await asyncio.sleep(3.0)
        await asyncio.to_thread(fleet.redis.restart)
        outage.append(Window(t0, await serving_again(fleet)))

    report = await run(fleet, redis_stopped_3s, users=10, timeout_s=8.0, context={"outage": outage})
    (down,) = outage
    # Redis holds keys, limits and spend, not requests: an accepted request goes
    # on (its settlement waits for Redis); a new one is refused 503, fail closed,
    # and only while Redis is away (its keys survive the restart: the AOF). As it
    # comes back, every user's next request lands at once: shedding may refuse
    # part of that burst (429 deadline_unmeetable, with Retry-After) until the
    # queue is short again; still inside the fault's window.
    report.assert_no_failures("Redis holds no request in flight")
    report.assert_rejections(
        {"accounting_unavailable", "service_unavailable", "deadline_unmeetable"},
        lambda o: o.open_during(down),
    )
    try:
        report.assert_served_after(down.end, "Redis came back")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; sheds: {shed_events(fleet)[:5]}") from None
    judged(report, "Redis stopped 3 s", f"; outage {down.end - down.start:.2f}s")


# The faults that end a request, and how: a drop after 5 tokens (the client saw
# tokens: never retried), a stall after the first token (ends at the deadline).
# 429 and 503 are retried by redelivery; a request whose every attempt drew one
# fails with it after MAX_ATTEMPTS failed attempts (the topology's max_attempts). stall:300
# (a late first token) and slow:20 only slow a request down.
ENDING = {"drop:5": "stream_interrupted", "stall": "deadline_exceeded"}
RETRIED = {"429": "engine_rate_limited", "503": "engine_unavailable"}
MAX_ATTEMPTS = DEFAULT_TOPOLOGY.limits.max_attempts


async def test_engine_faults(make_fleet: Callable[..., Fleet]) -> None:
    rates = ["429=0.08", "503=0.08", "drop:5=0.05", "stall:300=0.05", "stall=0.03", "slow:20=0.1"]
    fleet = make_fleet(workers=2, sim_args=[a for r in rates for a in ("--fault-rate", r)])

    def engine_faults_429_503_drop_stall_slow() -> None:
        return None  # injected by the simulator at the rates above

    report = await run(fleet, engine_faults_429_503_drop_stall_slow, users=12, timeout_s=6.0)
    injected: dict[str, int] = (await engine_stats(fleet))["faults"]
    ids = [o.request_id for o in report.accepted_outcomes() if o.request_id]
    engine = await engine_records(fleet, ids)
    # A request's engine record is its last attempt's: it fails exactly when
    # that attempt drew a fault that ends it, and with that fault's code.
    codes = {**ENDING, **RETRIED}
    expected = {rid: codes[r["fault"]] for rid, r in engine.items() if r.get("fault") in codes}
    report.assert_failures(
        set(expected),
        set(codes.values()),
        "last attempt drew a drop or a stall (or all 5 a 429/503)",
    )
    failed = {o.request_id: o.error for o in report.failed_outcomes()}
    assert failed == expected, sorted(set(failed.items()) ^ set(expected.items()))[:5]
    ceiling = sum(injected.get(k, 0) for k in ENDING)
    ceiling += sum(injected.get(k, 0) for k in RETRIED) // MAX_ATTEMPTS
    assert report.failed <= ceiling, (report.failed, injected)
    report.assert_rejections(())
    judged(report, "engine faults", f"; the simulator injected {injected}")


async def test_gateway_killed_with_clients_attached(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(gateways=2, workers=2)
    killed: list[Window] = []

    async def gateway_replica_sigkill_resume_elsewhere() -> None:
        await asyncio.sleep(3.0)
        t0 = time.time()
        fleet.gateways[0].kill()
        killed.append(Window(t0, time.time()))

    report = await run(
        fleet,
        gateway_replica_sigkill_resume_elsewhere,
        users=10,
        timeout_s=10.0,
        resume=True,
        headers={"X-Sim-Fault": "slow:20"},
        context={"killed": killed},
    )
    (kill,) = killed
    # Every accepted stream resumes on the other replica with Last-Event-ID.
    # Only a request whose connection broke before its response headers has no
    # id to resume by: refused, and only if it was open at the kill.
    report.assert_no_failures("every stream resumes on the other replica")
    report.assert_rejections(TRANSPORT_ERRORS, lambda o: o.open_during(kill))
    resumed = sum(o.resumed for o in report.outcomes)
    judged(report, "gateway SIGKILL, clients attached", f"; resumed {resumed}")


async def test_worker_sigterm_drains(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2)
    drained: list[Window] = []

    async def worker_sigterm_drain() -> None:
        await asyncio.sleep(3.0)
        await asyncio.to_thread(fleet.start_worker)
        t0 = time.time()
        fleet.workers[0].signal(signal.SIGTERM)
        await until_sync(lambda: fleet.workers[0].proc.poll() is not None, "drained")
        drained.append(Window(t0, time.time()))

    report = await run(
        fleet,
        worker_sigterm_drain,
        users=10,
        timeout_s=10.0,
        headers={"X-Sim-Fault": "slow:10"},
        context={"drained": drained},
    )
    # A draining worker finishes what it started and hands back (nak) what it
    # had not: nothing fails, nothing is refused.
    report.assert_no_failures("a drain finishes or hands back everything")
    report.assert_rejections(())
    (drain,) = drained
    judged(report, "worker SIGTERM", f"; drained in {drain.end - drain.start:.2f}s")


# Once a cluster serves again, a request waits its turn behind the backlog: at
# most one per virtual user, each well under a second on 2 workers.
BACKLOG_S = 5.0


async def test_nats_cluster_node_killed(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2, nats_nodes=3)
    # Longer than the R3 groups' failover (nats-server's Raft election timeout
    # is 4-9 s) plus a redelivery (ack_wait 10 s): so waiting out the kill is
    # no reason to miss a deadline; only frames on the dead node's connections are.
    timeout_s = 25.0
    killed: list[Window] = []
    reconnected: list[Window] = []
    peers: set[str] = set()

    async def one_of_3_nats_nodes_sigkilled_r3_streams() -> None:
        await asyncio.sleep(3.0)
        # Kill a node that is not the first one listed, to vary who reconnects.
        node = fleet.nats_nodes[1]
        procs = [*fleet.gateways, *fleet.workers]
        ports = {n.port for n in fleet.nats_nodes}
        before = connections(procs, ports)
        peers.update(tcp_peers(procs, node.port))
        t0 = time.time()
        node.kill()
        live = ports - {node.port}

        def back() -> bool:
            now = connections(procs, live)
            return all(now[p] >= n for p, n in before.items())

        await until_sync(back, "every process reconnected to a live node")
        reconnected.append(Window(t0, time.time()))
        killed.append(Window(t0, await serving_again(fleet)))
        # The load goes on through the backlog's allowance (below), so that
        # requests are sent after it too.
        await asyncio.sleep(BACKLOG_S)

    report = await run(
        fleet,
        one_of_3_nats_nodes_sigkilled_r3_streams,
        users=10,
        timeout_s=timeout_s,
        context={"killed": killed, "reconnected": reconnected, "peers": peers},
    )
    (kill,) = killed
    (cut,) = reconnected
    # At risk (a): frames published on a connection to the dead node before its
    # process reconnected are lost, so a stream relayed by a gateway on it, or
    # served by a worker on it, may end stream_interrupted (started), or at its
    # deadline or answer_lost (its whole answer lost: the gateway's queue watch
    # ends it before the deadline when it can). A stream another worker completed was not
    # on the dead node, unless its gateway was. (b): a request that could not be
    # served before its deadline because the cluster served nobody until
    # kill.end (plus its turn in the backlog): deadline_exceeded.
    gateway_cut = any(p.startswith("gateway") for p in peers)
    cut_workers = {worker_id(w) for w in fleet.workers if w.name in peers}
    frames_lost: set[str] = set()
    too_late: set[str] = set()
    for o in report.accepted_outcomes():
        assert o.request_id is not None
        served_by = str(report.records.get(o.request_id, {}).get("worker", ""))
        elsewhere = o.kind == "completed" and served_by not in cut_workers
        if o.open_during(cut) and (gateway_cut or (cut_workers and not elsewhere)):
            frames_lost.add(o.request_id)
        if o.open_during(kill) and o.sent_at + timeout_s < kill.end + BACKLOG_S:
            too_late.add(o.request_id)
    report.assert_failures(
        frames_lost | too_late,
        {"stream_interrupted", "deadline_exceeded", "answer_lost"},
        f"in flight on connections to the killed node ({', '.join(sorted(peers)) or 'none'})",
    )
    interrupted = [
        o.request_id for o in report.failed_outcomes() if o.error == "stream_interrupted"
    ]
    assert set(interrupted) <= frames_lost, interrupted
    # Shedding measured the failover: a start rate near zero and stretched
    # first-token delays, which fresh answers replace in a few seconds. Until
    # then (BACKLOG_S, as above) it may still refuse a new request, 429 with
    # Retry-After; from then on everything sent completes.
    settled = kill.end + BACKLOG_S
    report.assert_rejections(STALLED_BUS, lambda o: o.open_during(Window(kill.start, settled)))
    report.assert_served_after(settled, "the cluster served again and its backlog drained")
    judged(
        report,
        "3-node cluster, one node SIGKILLed",
        f"; reconnected after {cut.end - cut.start:.2f}s, "
        f"served again after {kill.end - kill.start:.2f}s",
    )


def shed_events(fleet: Fleet) -> list[dict[str, object]]:
    """The gateways' shedding refusals, with the inputs of each verdict."""
    return [
        e
        for i in range(fleet.spec.gateways)
        for e in events(fleet, f"gateway{i}")
        if e.get("event") == "shed"
    ]

"""The fault suite: each scenario runs steady streaming load against a real fleet
while a fault is injected, then reconciles what clients saw with the ledger.
Every accepted request must end completed or visibly failed: lost, duplicated
and hung must all be 0. Run alone with ``pytest -m faults -s`` to see the table."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Callable

import pytest

from jetserve.fleet import Fleet
from tests.faults.harness import Load, check, references

pytestmark = [pytest.mark.connected, pytest.mark.faults, pytest.mark.timeout(180)]


async def run(
    fleet: Fleet, fault: Callable[[], object] | None, *, duration: float = 10.0, **load: object
) -> None:
    refs = await references(fleet)
    driver = Load(fleet, **load)  # type: ignore[arg-type]
    running = asyncio.create_task(driver.run(duration))
    if fault is not None:
        result = fault()
        if asyncio.iscoroutine(result):
            await result
    outcomes = await running
    report = await check(fleet, outcomes, refs)
    print("\n" + report.row(fault_name(fault)))
    assert report.accepted > 0
    report.assert_nothing_lost()


def fault_name(fault: object) -> str:
    return getattr(fault, "__name__", "no fault").strip("_")


async def test_worker_sigkill_x20(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=3)
    rng = random.Random(3)

    async def worker_sigkill_x20() -> None:
        await asyncio.sleep(1.0)
        for _ in range(20):
            live = [w for w in fleet.workers if w.proc.poll() is None]
            rng.choice(live).kill()
            await asyncio.to_thread(fleet.start_worker, wait=False)
            await asyncio.sleep(0.4)

    await run(fleet, worker_sigkill_x20, duration=12.0, users=12, timeout_s=20.0)


async def test_nats_server_restart(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2)

    async def nats_server_restart() -> None:
        await asyncio.sleep(3.0)
        assert fleet.nats is not None
        await asyncio.to_thread(fleet.nats.restart)

    await run(fleet, nats_server_restart, users=10, timeout_s=10.0)


async def test_redis_stop_and_restart(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2)

    async def redis_stopped_3s() -> None:
        await asyncio.sleep(2.5)
        assert fleet.redis is not None
        await asyncio.to_thread(fleet.redis.stop)
        await asyncio.sleep(3.0)
        await asyncio.to_thread(fleet.redis.restart)

    await run(fleet, redis_stopped_3s, users=10, timeout_s=8.0)


async def test_engine_faults(make_fleet: Callable[..., Fleet]) -> None:
    rates = ["429=0.08", "503=0.08", "drop:5=0.05", "stall:300=0.05", "stall=0.03", "slow:20=0.1"]
    fleet = make_fleet(workers=2, sim_args=[a for r in rates for a in ("--fault-rate", r)])

    def engine_faults_429_503_drop_stall_slow() -> None:
        return None  # injected by the simulator at the rates above

    await run(fleet, engine_faults_429_503_drop_stall_slow, users=12, timeout_s=6.0)


async def test_gateway_killed_with_clients_attached(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(gateways=2, workers=2)

    async def gateway_replica_sigkill_resume_elsewhere() -> None:
        await asyncio.sleep(3.0)
        fleet.gateways[0].kill()

    await run(
        fleet,
        gateway_replica_sigkill_resume_elsewhere,
        users=10,
        timeout_s=10.0,
        resume=True,
        headers={"X-Sim-Fault": "slow:20"},
    )


async def test_worker_sigterm_drains(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2)

    async def worker_sigterm_drain() -> None:
        await asyncio.sleep(3.0)
        await asyncio.to_thread(fleet.start_worker)
        fleet.workers[0].signal(signal.SIGTERM)

    await run(
        fleet, worker_sigterm_drain, users=10, timeout_s=10.0, headers={"X-Sim-Fault": "slow:10"}
    )


async def test_nats_cluster_node_killed(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=2, nats_nodes=3)

    async def one_of_3_nats_nodes_sigkilled_r3_streams() -> None:
        await asyncio.sleep(3.0)
        # Kill a node that is not the first one listed, to vary who reconnects.
        fleet.nats_nodes[1].kill()

    await run(fleet, one_of_3_nats_nodes_sigkilled_r3_streams, users=10, timeout_s=10.0)

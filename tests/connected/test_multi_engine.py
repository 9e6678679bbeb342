"""One worker process driving several engines (`jetserve worker --engine A
--engine B`): each engine is a replica of its own (worker id, lanes, admission),
through a real gateway, NATS and two simulators; the process serves one /metrics
with a ``replica`` label, which promtool accepts."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jetserve.fleet import Fleet
from tests.connected.test_affinity import ask, served_by
from tests.scrape import promtool_check
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(120)]


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]


async def test_one_process_serves_two_engines_as_two_replicas(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0)
    second = fleet.start_engine()
    fleet.start_worker("--engine", second, "--max-inflight", "2", wait=False)
    fleet.wait_workers(2)  # two replicas pulling: one process
    assert len(fleet.workers) == 1
    url = f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics"

    async with httpx.AsyncClient(timeout=30) as client:

        async def both_ranked() -> bool:
            text = (await client.get(url)).text
            members = _samples(text, "jetserve_worker_lane_members")
            return len(members) == 2 and all(v == 2 for _, v in members)

        await until(both_ranked, "each replica ranking the lanes between the two of them")
        text = (await client.get(url)).text
        replicas = {
            labels["replica"] for labels, _ in _samples(text, "jetserve_worker_lane_members")
        }
        assert len(replicas) == 2
        # The process's own CPU once, not per replica.
        assert len(_samples(text, "process_cpu_seconds_total")) == 1
        ready = (await client.get(url.replace("/metrics", "/readyz"))).json()
        assert ready == {"ready": True, "checks": {"nats": True, "engine": True}}

        # Prefix groups spread over both replicas' lanes: both engines serve.
        ids = await asyncio.gather(*(ask(client, fleet, g, q) for g in range(12) for q in range(2)))
        workers = await served_by(fleet, list(ids))
        served = Counter(workers.values())
        assert set(served) == replicas, served

        text = (await client.get(url)).text
        await asyncio.to_thread(promtool_check, text)

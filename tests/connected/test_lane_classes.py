"""A class's lanes are owned among the workers that pull the class
(streams/membership.py ``order``): deploy/ runs one Deployment per class, all
members of one bucket."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from gateway.inference.lanes import LaneRouter
from jetserve.fleet import Fleet
from streams.definitions import Topology
from streams.rendezvous import assign
from streams.routes import RoutingPolicy
from tests.prompts import chat
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]


async def test_a_lane_ranked_to_workers_of_other_classes_is_still_served(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Among every member, an interactive lane whose owner and backups were all
    embed workers had no puller: a request hashed there waited out its deadline
    (504), with an interactive worker idle."""
    fleet = make_fleet(workers=1, worker_id_suffix="rv")
    for _ in range(5):
        fleet.start_worker("--classes", "embed", wait=False)
    url = f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics"

    async def settled() -> bool:
        async with httpx.AsyncClient(timeout=5) as c:
            text = (await c.get(url)).text
        members = metric_sum(text, "jetserve_worker_lane_members")
        return members == 6 and metric_sum(text, "jetserve_worker_lane_stale_pullers") == 0

    await until(settled, "six members, the chat worker's lanes settled", bound_s=90)
    ids = [w.args[w.args.index("--worker-id") + 1] for w in fleet.workers]
    among_all = assign(ids, fleet.spec.lanes)
    orphan = [n for n in range(fleet.spec.lanes) if ids[0] not in among_all.orders[n]]
    assert orphan  # the ids are fixed: so is the assignment
    router = LaneRouter(Topology(lanes=fleet.spec.lanes))

    def lane(group: int) -> int:
        subject = router.subject("chat", "interactive", fleet.spec.tenant, chat(group, 0),
                                 RoutingPolicy())  # fmt: skip
        return int(subject.rsplit(".l", 1)[1])

    group = next(g for g in range(10_000) if lane(g) in orphan)
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "60"}
    url = f"{fleet.base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=90) as c:
        r = await c.post(url, json=chat(group, 0), headers=headers)
    assert r.status_code == 200, r.text

"""Prefix affinity on JetStream priority groups, through real processes: four
replicas (a worker with its own simulator each), the gateway hashing shared
prefixes onto lanes, workers pulling lanes at their priority."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import httpx
import msgspec
import pytest

from gateway.inference.lanes import LaneRouter
from jetserve.fleet import Fleet
from streams.definitions import Topology
from streams.rendezvous import assign
from streams.routes import RoutingPolicy
from tests.prompts import chat
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(120)]


async def ask(
    client: httpx.AsyncClient, fleet: Fleet, group: int, question: int, **headers: str
) -> str:
    r = await client.post(
        f"{fleet.base_url}/v1/chat/completions",
        json=chat(group, question),
        headers={"Authorization": f"Bearer {fleet.api_key}", **headers},
    )
    assert r.status_code == 200, r.text
    return str(r.headers["x-request-id"])


async def served_by(fleet: Fleet, ids: list[str]) -> dict[str, str]:
    """request id -> worker, from the ledger (records land just after the response)."""
    want = set(ids)
    for _ in range(50):
        with fleet.admin() as admin:
            text = await asyncio.to_thread(admin.ledger, fleet.spec.tenant)
        rows = [msgspec.json.decode(line) for line in text.splitlines() if line]
        got = {r["request_id"]: r["worker"] for r in rows if r["request_id"] in want}
        if len(got) == len(want):
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"ledger lacks {len(want - set(got))} records")


async def settled(fleet: Fleet) -> None:
    """Workers started one after another: until every worker ranks the lanes among
    all of them, and has withdrawn the pulls it made at older ranks, a lane may
    still go to its former owner. Waits on the workers' own gauges."""
    urls = [f"http://127.0.0.1:{p}/metrics" for p in fleet.worker_metrics_ports]
    n = len(urls)

    async def ranked() -> bool:
        async with httpx.AsyncClient(timeout=5) as c:
            texts = [(await c.get(u)).text for u in urls]
        return all(
            metric_sum(t, "jetserve_worker_lane_members") == n
            and metric_sum(t, "jetserve_worker_lane_stale_pullers") == 0
            for t in texts
        )

    await until(ranked, "every worker ranking the lanes among all of them")


async def test_shared_prefixes_stick_to_one_replica_and_fail_over(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=4, engine_per_worker=True)
    await settled(fleet)
    groups = range(8)
    async with httpx.AsyncClient(timeout=30) as client:

        async def group_run(g: int, questions: range) -> list[str]:
            return [await ask(client, fleet, g, q) for q in questions]

        per_group = await asyncio.gather(*(group_run(g, range(4)) for g in groups))
        workers = await served_by(fleet, [rid for ids in per_group for rid in ids])
        owners: dict[int, Counter[str]] = {
            g: Counter(workers[rid] for rid in ids)
            for g, ids in zip(groups, per_group, strict=True)
        }
        # A group's requests land on its lane's owner; a burst of groups that
        # share a lane may spill one over (the owner was momentarily full).
        on_owner = sum(c.most_common(1)[0][1] for c in owners.values())
        assert on_owner >= 0.9 * len(workers), owners
        # ... and the groups spread over the replicas.
        assert len({c.most_common(1)[0][0] for c in owners.values()}) >= 2, owners

        # The owner of group 0 dies: its requests go on, elsewhere, none lost.
        dead = owners[0].most_common(1)[0][0]
        victim = next(w for w in fleet.workers if dead.startswith(w.name))
        victim.kill()
        after = await group_run(0, range(10, 16))
        moved = await served_by(fleet, after)
        assert dead not in moved.values()
        # The group has moved to the next in its lane's order; a replica that
        # took a whole group on top of its own is hot (streams/balance.py) and
        # may pass some on to the next after it, but no further.
        assert len(set(moved.values())) <= 2, moved


async def test_a_saturated_owner_spills_over(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=3, engine_per_worker=True, worker_args=["--max-inflight", "2"])
    await settled(fleet)
    async with httpx.AsyncClient(timeout=30) as client:
        # One group, more at once than its owner may hold: the rest spill over
        # rather than queue behind the owner.
        ids = await asyncio.gather(
            *(ask(client, fleet, 3, q, **{"X-Sim-Fault": "slow:40"}) for q in range(12))
        )
    workers = await served_by(fleet, list(ids))
    assert len(set(workers.values())) >= 2, workers


async def test_every_worker_owns_lanes_by_the_load_factor_the_stream_records(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The gateway provisions ``--lane-load-factor 1.0``; the workers are told
    nothing and take it from the stream. With these ids, lanes 0 and 14 have
    other owners at 1.0 than at the default 1.4 (the cap binds), so a worker
    computing with its own default would serve them elsewhere."""
    fleet = make_fleet(workers=3, worker_id_suffix="lf", gateway_args=["--lane-load-factor", "1.0"])
    await settled(fleet)
    ids = [w.args[w.args.index("--worker-id") + 1] for w in fleet.workers]
    at_1, at_default = assign(ids, fleet.spec.lanes, load_factor=1.0), assign(ids, fleet.spec.lanes)
    router = LaneRouter(Topology(lanes=fleet.spec.lanes))

    def lane(group: int) -> int:
        subject = router.subject("chat", "interactive", fleet.spec.tenant, chat(group, 0),
                                 RoutingPolicy())  # fmt: skip
        return int(subject.rsplit(".l", 1)[1])

    differ = [n for n in range(fleet.spec.lanes) if at_1.owner(n) != at_default.owner(n)]
    assert differ == [0, 14]  # the ids are fixed: so is the assignment
    groups = [next(g for g in range(1000) if lane(g) == n) for n in differ]
    async with httpx.AsyncClient(timeout=30) as client:
        # One at a time: each owner has room, and no replica is hot (streams/balance.py).
        asked = [await ask(client, fleet, g, 0) for g in groups]
    workers = await served_by(fleet, asked)
    assert [workers[rid] for rid in asked] == [at_1.owner(n) for n in differ]

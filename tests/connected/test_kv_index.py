"""KV-event-aware routing through real processes: simulators publishing vLLM's
KV events over ZMQ, workers feeding the fleet's KV index on NATS, a gateway
with ``--kv-index`` routing by it (docs/routing.md, "KV-event-aware routing")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

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

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]


async def ask(client: httpx.AsyncClient, fleet: Fleet, group: int, question: int) -> str:
    r = await client.post(
        f"{fleet.base_url}/v1/chat/completions",
        json=chat(group, question),
        headers={"Authorization": f"Bearer {fleet.api_key}"},
    )
    assert r.status_code == 200, r.text
    return str(r.headers["x-request-id"])


async def served_by(fleet: Fleet, ids: Sequence[str]) -> dict[str, str]:
    """request id -> worker, from the ledger (records land just after the response)."""
    want, got = set(ids), {}

    async def read() -> bool:
        with fleet.admin() as admin:
            text = await asyncio.to_thread(admin.ledger, fleet.spec.tenant)
        rows = [msgspec.json.decode(line) for line in text.splitlines() if line]
        got.update({r["request_id"]: r["worker"] for r in rows if r["request_id"] in want})
        return len(got) == len(want)

    await until(read, "the ledger records of the requests")
    return got


async def scrape(urls: Sequence[str]) -> list[str]:
    async with httpx.AsyncClient(timeout=5) as c:
        return [(await c.get(u)).text for u in urls]


def worker_urls(fleet: Fleet) -> list[str]:
    return [f"http://127.0.0.1:{p}/metrics" for p in fleet.worker_metrics_ports]


async def gateway_metric(fleet: Fleet, name: str, **labels: str) -> float:
    [text] = await scrape(fleet.gateway_metrics_urls[:1])
    return metric_sum(text, name, **labels)


async def settled(fleet: Fleet) -> None:
    """Every worker ranks the lanes among all of them (its old pulls withdrawn),
    and the gateway's KV router sees them all too."""
    n = len(fleet.worker_metrics_ports)

    async def ranked() -> bool:
        texts = await scrape(worker_urls(fleet))
        members = await gateway_metric(fleet, "jetserve_gateway_kv_index_members")
        return members == n and all(
            metric_sum(t, "jetserve_worker_lane_members") == n
            and metric_sum(t, "jetserve_worker_lane_stale_pullers") == 0
            for t in texts
        )

    await until(ranked, "every worker and the gateway seeing all the workers")


async def indexed(fleet: Fleet, requests: int) -> None:
    """The workers have learnt from ``requests`` requests with prefix keys, and
    the gateway's index holds exactly what the workers say they hold."""

    async def caught_up() -> bool:
        texts = await scrape(worker_urls(fleet))
        seen = sum(metric_sum(t, "jetserve_worker_kv_index_requests_total") for t in texts)
        held = sum(metric_sum(t, "jetserve_worker_kv_index_keys") for t in texts)
        entries = await gateway_metric(fleet, "jetserve_gateway_kv_index_entries")
        return seen >= requests and held > 0 and entries == held

    await until(caught_up, "the gateway's KV index caught up with the workers")


def worker_ids(fleet: Fleet) -> list[str]:
    return [w.args[w.args.index("--worker-id") + 1] for w in fleet.workers]


async def routes(fleet: Fleet) -> tuple[float, float]:
    name = "jetserve_gateway_kv_routes_total"
    return (
        await gateway_metric(fleet, name, source="index"),
        await gateway_metric(fleet, name, source="hash"),
    )


async def test_a_cached_prefix_keeps_its_replica_when_its_hash_lane_moves(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(
        workers=2, engine_per_worker=True, kv_events=True, gateway_args=["--kv-index"]
    )
    await settled(fleet)
    groups = range(16)
    async with httpx.AsyncClient(timeout=30) as client:
        # Cold: each group's first request goes to its hash lane; one at a time,
        # so each worker can tell which chain of blocks each request stored.
        first = [await ask(client, fleet, g, 0) for g in groups]
        assert await routes(fleet) == (0.0, len(groups))
        holder = await served_by(fleet, first)
        await indexed(fleet, len(groups))

        # A third replica joins: rendezvous moves about a third of the lanes to it.
        fleet.start_worker()
        await settled(fleet)
        members = worker_ids(fleet)
        order = assign(members, fleet.spec.lanes)
        lanes = LaneRouter(Topology(lanes=fleet.spec.lanes))
        hash_owner = {}
        for g in groups:
            subject = lanes.subject("chat", "interactive", fleet.spec.tenant, chat(g, 1),
                                    RoutingPolicy())  # fmt: skip
            hash_owner[g] = order.owner(int(subject.rsplit(".l", 1)[1]))
        moved = [g for g in groups if hash_owner[g] != holder[first[g]]]
        assert moved, "no group's hash lane moved to the new replica"

        # Each group goes back to the replica that holds its prefix, through a
        # lane that replica owns, not to its hash lane's new owner.
        second = [await ask(client, fleet, g, 1) for g in groups]
        again = await served_by(fleet, second)
    assert {g: again[second[g]] for g in groups} == {g: holder[first[g]] for g in groups}
    index, hashed = await routes(fleet)
    assert index == len(groups)
    assert hashed == len(groups)  # the cold ones only


async def test_eviction_withdraws_a_prefix_and_a_cold_index_hashes(
    make_fleet: Callable[..., Fleet],
) -> None:
    # One replica whose cache holds about two of these prompts (24 blocks of 16 tokens).
    fleet = make_fleet(
        workers=1,
        engine_per_worker=True,
        kv_events=True,
        gateway_args=["--kv-index"],
        sim_args=["--num-gpu-blocks", "24"],
    )
    await settled(fleet)
    async with httpx.AsyncClient(timeout=30) as client:
        await ask(client, fleet, 0, 0)
        assert await routes(fleet) == (0.0, 1.0)  # cold: hashed
        await indexed(fleet, 1)
        await ask(client, fleet, 0, 1)
        assert await routes(fleet) == (1.0, 1.0)  # its prefix is held: the index
        # Four other prefixes push group 0's blocks out of the engine's cache.
        for n, g in enumerate(range(1, 5)):
            await ask(client, fleet, g, 0)
            await indexed(fleet, 2 + n + 1)
        before = await routes(fleet)
        await ask(client, fleet, 0, 2)
        after = await routes(fleet)
    assert after == (before[0], before[1] + 1)  # evicted (BlockRemoved): hashed again

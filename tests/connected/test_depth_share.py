"""One queue-depth reader for the fleet (gateway/inference/depth_share.py),
through real gateways on real NATS: one gateway lists the consumers and the
others take its published looks; when the reader is SIGKILLed another is
elected and the numbers keep following the queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from gateway.inference.depth_share import LEASE_KEY, DepthShare
from jetserve.fleet import Fleet
from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.depth import DEPTH_SUBJECT, LOOK_ENCODER, ClassDepth, DepthLook
from streams.leases import KvLease, ensure_leases
from tests.scrape import metric_sum
from tests.waits import until, until_true

pytestmark = pytest.mark.connected

LOOKS = "jetserve_gateway_depth_looks_total"


async def scrape(url: str) -> str:
    async with httpx.AsyncClient(timeout=5) as c:
        return (await c.get(url)).text


async def depth(url: str) -> float:
    return metric_sum(await scrape(url), "jetserve_queue_depth", cls="interactive")


async def send(client: httpx.AsyncClient, fleet: Fleet, base_url: str, n: int) -> list[int]:
    """``n`` interactive requests through ``base_url``; their statuses once answered."""
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "60"}

    async def one(i: int) -> int:
        msg = {"role": "user", "content": f"queued {base_url} {i}"}
        body = {"model": "sim-8b", "max_tokens": 4, "messages": [msg]}
        try:
            r = await client.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
        except httpx.TransportError:
            return 0  # its gateway was killed
        return r.status_code

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_one_gateway_reads_the_depths_and_another_is_elected_when_it_dies(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0, gateways=2)  # nothing consumes: requests wait
    urls = fleet.gateway_metrics_urls
    async with httpx.AsyncClient(timeout=90) as client:
        first = asyncio.create_task(send(client, fleet, fleet.base_urls[1], 5))

        async def both_see_five() -> bool:
            return [await depth(u) for u in urls] == [5.0, 5.0]

        await until(both_see_five, "both gateways see the 5 queued requests")
        texts = [await scrape(u) for u in urls]
        readers = [metric_sum(t, "jetserve_gateway_depth_reader") for t in texts]
        assert sorted(readers) == [0.0, 1.0], readers
        reader = readers.index(1.0)
        follower = 1 - reader
        # The follower never listed the consumers: every number it holds was heard.
        assert metric_sum(texts[follower], LOOKS, source="read") == 0
        assert metric_sum(texts[follower], LOOKS, source="heard") > 0
        assert metric_sum(texts[reader], LOOKS, source="read") > 0

        # The reader dies without a goodbye: its lease runs out, the follower
        # is elected and follows the queue as it grows.
        fleet.gateways[reader].signal(9)
        survivor = urls[follower]

        async def survivor_reads() -> bool:
            return metric_sum(await scrape(survivor), "jetserve_gateway_depth_reader") == 1.0

        await until(survivor_reads, "the survivor is elected")
        second = asyncio.create_task(send(client, fleet, fleet.base_urls[follower], 3))

        async def eight() -> bool:
            # The dead gateway's requests keep their place in the queue.
            return await depth(survivor) == 8.0

        await until(eight, "the survivor reads the grown queue")
        assert metric_sum(await scrape(survivor), LOOKS, source="read") > 0

        # A worker arrives: the queue drains and the survivor's requests are answered.
        await asyncio.to_thread(fleet.start_worker, wait=False)
        assert await second == [200] * 3
        answered = await first
        assert answered == ([0] * 5 if reader == 1 else [200] * 5), answered


async def test_a_busy_workers_peeks_are_answered_from_the_looks(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A lower class's puller on a busy worker asks, before taking a slot,
    whether its consumer holds work: from the reader's looks, not the server."""
    fleet = make_fleet(workers=1)
    worker_metrics = f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics"
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "60"}
    async with httpx.AsyncClient(timeout=90) as client:
        # A batch request first: the batch puller has polled and found its queue
        # empty, so while the worker is busy it peeks before pulling again.
        body = {"model": "sim-8b", "max_tokens": 2, "messages": [{"role": "user", "content": "b"}]}
        r = await client.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=body,
            headers={**headers, "X-Jetserve-Class": "batch"},
        )
        assert r.status_code == 200, r.text

        # Interactive requests whose first token is 3 s late keep it busy.
        stalled = asyncio.gather(
            *(
                client.post(
                    f"{fleet.base_url}/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": f"i{i}"}]},
                    headers={**headers, "X-Sim-Fault": "stall:3000"},
                )
                for i in range(3)
            )
        )

        async def peeked_from_looks() -> bool:
            text = await scrape(worker_metrics)
            return metric_sum(text, "jetserve_worker_pending_peeks_total", source="look") > 0

        await until(peeked_from_looks, "a peek answered from the reader's look")
        # Batch work arriving while it is busy is seen in the looks and served.
        r = await client.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=body,
            headers={**headers, "X-Jetserve-Class": "batch"},
        )
        assert r.status_code == 200, r.text
        assert [x.status_code for x in await stalled] == [200] * 3


async def test_a_heartbeat_is_not_taken_as_a_new_look(nats_server: Service) -> None:
    """The reader republishes its last look every renew_s, its time unchanged (and
    goes on doing so when it cannot look): a follower took each as a look in
    which nothing started, its start rate decayed, and within ~20 s it refused
    every class with a queue while the reader admitted."""
    url = f"nats://127.0.0.1:{nats_server.port}"
    reader = await connect(url, "reader", nats_server.bus_auth(Role.GATEWAY))
    follower = await connect(url, "follower", nats_server.bus_auth(Role.GATEWAY))
    taken: list[DepthLook] = []

    async def lease() -> KvLease:
        return KvLease(await ensure_leases(follower.jetstream()), LEASE_KEY, "f", ttl_s=180)

    share = DepthShare(follower, "f", lease, taken.append, lambda: None, renew_s=60)
    try:
        await share.start()
        await follower.flush()  # its subscription is at the server before anything is sent
        depths = {"interactive": ClassDepth(pending=20, delivered=50, found=True)}
        look = DepthLook("r", depths, 1000.0)
        newer = DepthLook("r", depths, 1001.0)
        behind = DepthLook("r2", depths, 995.0)  # a new reader, its clock behind
        for sent in (look, look, look, newer, behind, behind):  # heartbeats between
            await reader.publish(DEPTH_SUBJECT, LOOK_ENCODER.encode(sent))
        await until_true(lambda: bool(taken) and taken[-1].reader == "r2", "r2's look")
        assert [(t.reader, t.at) for t in taken] == [("r", 1000.0), ("r", 1001.0), ("r2", 995.0)]
    finally:
        await share.stop()
        await follower.close()
        await reader.close()

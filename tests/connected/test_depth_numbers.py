"""A look's consumer list (streams/depth.py) on a real nats-server: the numbers
msgspec decodes from the raw ``CONSUMER.LIST`` replies are nats-py's own, over
more than one page, and an API error is nats-py's error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js.api import ConsumerConfig, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from jetserve.services import Service
from streams.connect import connect
from streams.depth import LIST_PAGE, consumer_infos, consumer_numbers

pytestmark = pytest.mark.connected

STREAM = "DEPTH_NUMBERS"


@pytest.fixture
async def nc(nats_server: Service) -> AsyncIterator[Client]:
    client = await connect(
        f"nats://127.0.0.1:{nats_server.port}", "test-depth", nats_server.bus_auth()
    )
    yield client
    await client.close()


async def test_the_numbers_are_nats_pys_over_two_pages(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["depth.>"], storage=StorageType.MEMORY))
    n = LIST_PAGE + 20  # a second page
    await asyncio.gather(
        *(
            js.add_consumer(
                STREAM,
                ConsumerConfig(
                    durable_name=f"c{i:03d}",
                    filter_subject=f"depth.{i % 4}",
                    mem_storage=True,
                ),
            )
            for i in range(n)
        )
    )
    for i in range(12):
        await js.publish(f"depth.{i % 4}", b"x")
    # Something delivered and waiting for its ack, on one consumer.
    sub = await js.pull_subscribe_bind("c001", STREAM)
    got = await sub.fetch(2, timeout=5)
    assert len(got) == 2

    full = {i.name: i for i in await consumer_infos(js, STREAM)}
    lean = {i.name: i for i in await consumer_numbers(js, STREAM)}
    assert len(lean) == n
    assert lean.keys() == full.keys()
    for name, info in full.items():
        mine = lean[name]
        assert mine.num_pending == (info.num_pending or 0), name
        assert mine.num_ack_pending == (info.num_ack_pending or 0), name
        assert mine.num_waiting == (info.num_waiting or 0), name
        seq = info.delivered.consumer_seq if info.delivered else 0
        assert (mine.delivered.consumer_seq if mine.delivered else 0) == (seq or 0), name
    assert lean["c001"].num_ack_pending == 2
    assert lean["c001"].delivered is not None
    assert lean["c001"].delivered.consumer_seq == 2
    assert lean["c002"].num_pending == 3  # depth.2: messages 2, 6, 10


async def test_a_missing_stream_is_nats_pys_not_found(nc: Client) -> None:
    with pytest.raises(NotFoundError):
        await consumer_numbers(nc.jetstream(), "NO_SUCH_STREAM")

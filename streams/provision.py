"""Idempotent provisioning: the gateway (and the admin role) call ``ensure_topology``
at start-up; the first creates, the rest find what they need (or update it in
place). Workers and executors may not change the request path's streams (their
NATS credentials forbid it): they ``await_topology`` until it is there."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from streams.definitions import DEFAULT_TOPOLOGY, Topology
from streams.errors import ProvisioningError


async def ensure_stream(js: JetStreamContext, want: StreamConfig) -> None:
    """Create the stream, or update it in place; safe with concurrent callers."""
    assert want.name is not None
    try:
        await js.stream_info(want.name)
    except NotFoundError:
        try:
            await js.add_stream(want)
            return
        except APIError as exc:  # a concurrent creator may have won the race
            try:
                await js.stream_info(want.name)
            except NotFoundError:
                raise ProvisioningError(f"cannot create stream {want.name}: {exc}") from exc
    try:
        await js.update_stream(want)
    except APIError as exc:  # a change the server refuses (storage type, deny_delete)
        raise ProvisioningError(f"cannot update stream {want.name}: {exc}") from exc


async def ensure_routes(js: JetStreamContext, topo: Topology = DEFAULT_TOPOLOGY) -> KeyValue:
    """Bind the route-contract bucket, creating it if absent (concurrent-safe)."""
    want = topo.routes_config()
    try:
        return await js.key_value(want.bucket)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(want)
        except (APIError, nats.errors.Error) as exc:  # a concurrent creator may have won
            try:
                return await js.key_value(want.bucket)
            except BucketNotFoundError:
                raise ProvisioningError(f"cannot create bucket {want.bucket}: {exc}") from exc


async def ensure_topology(js: JetStreamContext, topo: Topology = DEFAULT_TOPOLOGY) -> None:
    await ensure_stream(js, topo.stream_config())
    await ensure_stream(js, topo.frames_config())
    await ensure_stream(js, topo.dlq_config())
    await ensure_routes(js, topo)
    for cls in topo.classes:
        # Creating a durable with a config is create-or-update on nats-server >= 2.10.
        await js.add_consumer(topo.stream, topo.consumer_config(cls))
    for cls in topo.lane_classes:
        for lane in range(topo.lanes):
            await ensure_raw_consumer(js, topo.stream, topo.lane_consumer_config(cls, lane))
    for cls in topo.excess_classes:
        await js.add_consumer(topo.stream, topo.consumer_config(cls, excess=True))


async def ensure_raw_consumer(js: JetStreamContext, stream: str, config: dict[str, Any]) -> None:
    """Create-or-update a durable from a raw JSON config (fields nats-py lacks)."""
    name = config["durable_name"]
    subject = f"{js._prefix}.CONSUMER.CREATE.{stream}.{name}"  # nats-py keeps the API prefix here
    payload = json.dumps({"stream_name": stream, "config": config}).encode()
    try:
        reply = await js._nc.request(subject, payload, timeout=5.0)
    except (nats.errors.Error, TimeoutError) as exc:
        raise ProvisioningError(f"cannot create consumer {name}: {exc}") from exc
    answer = json.loads(reply.data)
    if "error" in answer:
        raise ProvisioningError(f"cannot create consumer {name}: {answer['error']}")


async def await_topology(
    js: JetStreamContext,
    topo: Topology = DEFAULT_TOPOLOGY,
    within_s: float = 120.0,
    consumers: bool = True,
) -> None:
    """Until the work-queue stream (and with ``consumers`` every class consumer)
    exists (a gateway provisions them); a ProvisioningError after ``within_s``."""
    names = [n for cls in topo.classes for n in topo.consumer_names(cls)] if consumers else []
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while True:
        try:
            await js.stream_info(topo.stream)
            for name in names:
                await js.consumer_info(topo.stream, name)
            return
        except (NotFoundError, nats.errors.Error, TimeoutError) as exc:
            if loop.time() > end:
                raise ProvisioningError(
                    f"{topo.stream} or its consumers missing after {within_s:g}s "
                    f"(is a gateway running?): {exc}"
                ) from exc
            await asyncio.sleep(0.5)

"""Idempotent provisioning: every process calls ``ensure_topology`` at start-up;
the first creates, the rest find what they need (or update it in place)."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import APIError, NotFoundError

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


async def ensure_topology(js: JetStreamContext, topo: Topology = DEFAULT_TOPOLOGY) -> None:
    await ensure_stream(js, topo.stream_config())
    await ensure_stream(js, topo.frames_config())
    await ensure_stream(js, topo.dlq_config())
    for cls in topo.classes:
        # Creating a durable with a config is create-or-update on nats-server >= 2.10.
        await js.add_consumer(topo.stream, topo.consumer_config(cls))

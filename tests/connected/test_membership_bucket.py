"""The worker members bucket (streams/membership.py) made by another worker
with other settings: a new worker binds it and joins."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import KeyValueConfig

from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.membership import MEMBERS_BUCKET, Membership
from streams.tasks import stop_task

pytestmark = pytest.mark.connected


async def test_a_worker_joins_a_members_bucket_made_with_other_settings(
    nats_server: Service, caplog: pytest.LogCaptureFixture
) -> None:
    # Made by a worker of another --replicas or another nats-py (allow_msg_ttl set
    # or not), the bucket's config differed from this worker's: its create was
    # refused ("already in use with a different configuration") and every new
    # worker of the fleet crashed at start.
    url = f"nats://127.0.0.1:{nats_server.port}"
    admin = await connect(url, "admin", nats_server.bus_auth())
    worker = await connect(url, "worker", nats_server.bus_auth(Role.WORKER))
    try:
        await admin.jetstream().create_key_value(
            KeyValueConfig(bucket=MEMBERS_BUCKET, history=1, ttl=60.0, description="an older one")
        )
        members = Membership(worker.jetstream(), "w-new", 1, every_s=1.0)
        await members.start()
        runner = asyncio.create_task(members.run())
        try:
            assert "w-new" in members.members
            # Bound as it is, and said so (a fleet "moved to R3" kept R1 buckets unseen).
            assert "bucket jetserve_workers has ttl_s 60.0, not the 4.0 asked for" in caplog.text
            entry = await (await admin.jetstream().key_value(MEMBERS_BUCKET)).get("w-new")
            assert entry.value
        finally:
            await stop_task(runner)
            await members.leave()
    finally:
        await worker.close()
        await admin.close()

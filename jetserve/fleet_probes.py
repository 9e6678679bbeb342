"""The readiness waits of a fleet (``jetserve/fleet.py``): a JetStream cluster
elects its meta leader, workers and executors park pull requests on their
consumers. Sync on the outside: a fleet is driven from plain code and tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import nats.errors

from streams.connect import OPEN, BusAuth, connect

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even under a running loop
    (a fleet is driven from async tests too): on a thread of its own."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def pulling(
    nats_url: str, stream: str, consumer: str, n: int, limit_s: float, auth: BusAuth = OPEN
) -> bool:
    """Whether ``n`` pull requests wait on ``consumer`` (that many members are
    live) within ``limit_s``."""
    nc = await connect(nats_url, "fleet-probe", auth)
    try:
        js = nc.jetstream()
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            # Not provisioned yet (the first member creates it): keep polling.
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                info = await js.consumer_info(stream, consumer)
                if (info.num_waiting or 0) >= n:
                    return True
            await asyncio.sleep(0.05)
        return False
    finally:
        await nc.close()


async def wait_jetstream(nats_url: str, limit_s: float, auth: BusAuth = OPEN) -> None:
    """A new cluster elects its JetStream meta leader first: wait for it."""
    nc = await connect(nats_url, "fleet-probe", auth)
    try:
        js = nc.jetstream()
        end = time.monotonic() + limit_s
        while True:
            try:
                await js.account_info()
                return
            except (nats.errors.Error, TimeoutError):
                if time.monotonic() > end:
                    raise
            await asyncio.sleep(0.2)
    finally:
        await nc.close()

"""Coalescing at its edges: a leader that leaves while its request is queued,
and a follower that joins a long run on another replica."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.connected.test_coalescing import long_chat, sim_stats, stream
from tests.tcp_cut import CutProxy
from tests.waits import until, until_sync

pytestmark = pytest.mark.connected


async def test_a_leader_gone_while_queued_leaves_the_request_to_its_followers(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A group's leader whose client hangs up while its request is being queued
    (the publish stored, its acknowledgement late): the request is the group's
    now, not its client's alone. Its followers (here one on another replica,
    reading the leader's capture) are served; before, the leader's hang-up
    cancelled the request by id at once, and they got an error (or waited to
    their deadline) for a cancel their own clients never sent."""
    # Real latencies, and an answer long enough to be generating still when the
    # leader's hang-up is heard (a cancel then would cut it short).
    fleet = make_fleet(workers=1, profile="h100-8b", gateway_args=["--coalesce"])
    body = long_chat(1000)
    async with (
        CutProxy(fleet.nats_nodes[0].port) as proxy,
        httpx.AsyncClient(timeout=60) as c,
    ):
        # Gateway 1 reaches NATS through the proxy: what the server sends it
        # (the publish's acknowledgement, the frames) can be held.
        fleet.start_gateway("--nats", proxy.url, wait=False)
        await asyncio.to_thread(fleet.wait_gateway, 1)  # off the loop: the proxy runs on it
        started = int((await sim_stats(c, fleet))["started"])

        def reserved() -> int:
            with fleet.admin() as admin:
                return int(admin.get_limits("tenant", fleet.spec.tenant)["reserved_micros"])

        proxy.stall()
        # A later deadline than the follower's (sent seconds after it): a group is
        # joined only by requests whose deadline it meets.
        patient = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "300"}

        async def lead() -> None:
            as_streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            url = f"{fleet.base_urls[1]}/v1/chat/completions"
            async with c.stream("POST", url, json=as_streamed, headers=patient) as r:
                await r.aread()

        leader = asyncio.create_task(lead())

        async def stored() -> bool:  # queued: the worker runs it, the ack is held
            return int((await sim_stats(c, fleet))["started"]) > started

        await until(stored, "the leader's request stored and started")
        held = await asyncio.to_thread(reserved)
        # On the other replica: it follows the leader's run through its capture.
        follower = asyncio.create_task(stream(c, fleet, body, at=0))

        async def following() -> bool:  # its hold taken: it waits for the group now
            return await asyncio.to_thread(reserved) > held

        await until(following, "the follower admitted, waiting for the group")
        leader.cancel()  # the leader's client hangs up, its request still being queued
        with pytest.raises(asyncio.CancelledError):
            await leader
        # The gateway hears the hang-up before the acknowledgement flows: its
        # server closes the leader's connection in the callback that tells the
        # handler the client is gone.
        gateway_1 = fleet.gateway_ports[1]
        await until_sync(lambda: not _serves_a_client(gateway_1), "gateway 1 hearing the hang-up")
        proxy.flow()
        _, text = await follower  # the whole answer, no error chunk (stream asserts)
        assert (await sim_stats(c, fleet))["started"] == started + 1  # one generation
    assert len(text.split()) > 500


def _serves_a_client(port: int) -> bool:
    """Whether a process holds the server end of a connection to ``port`` (open,
    or closed by its client and not yet by the server): /proc/net/tcp names the
    socket's inode, 0 once the server has closed it."""
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            local, remote = (int(fields[i].rsplit(":", 1)[1], 16) for i in (1, 2))
            if local == port and remote != 0 and fields[9] != "0":
                return True
    return False


async def test_a_follower_on_another_replica_joins_a_long_run_and_reads_it_all(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The follower's replica replays the leader's capture at once, far faster
    than any client reads: with members' buffers bounded (64 frames here) a fast
    client following a run past that many tokens ended ``client_too_slow``."""
    fleet = make_fleet(
        workers=1,
        gateways=2,
        profile="h100-8b",
        gateway_args=["--coalesce", "--max-buffered-frames", "64"],
    )
    body = long_chat(600)
    async with httpx.AsyncClient(timeout=60) as c:
        far_along = asyncio.Event()
        seen = 0

        async def lead() -> tuple[str, str]:
            nonlocal seen
            # A deadline past the follower's (sent seconds later): one it may follow.
            headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "300"}
            parts: list[str] = []
            as_streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            url = f"{fleet.base_urls[0]}/v1/chat/completions"
            async with c.stream("POST", url, json=as_streamed, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:]).get("choices", []):
                            parts.append(choice["delta"].get("content") or "")
                        seen += 1
                        if seen >= 150:  # the capture holds more than the bound now
                            far_along.set()
            return r.headers["x-request-id"], "".join(parts)

        leader = asyncio.create_task(lead())
        await far_along.wait()
        _, followed = await stream(c, fleet, body, at=1)  # no error chunk (stream asserts)
        _, led = await leader
        assert (await sim_stats(c, fleet))["started"] == 1  # it followed, not ran again
    assert followed == led

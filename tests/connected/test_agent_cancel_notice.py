"""A cancel whose core-NATS notice an executor missed (it was reconnecting, say)
still stops the turn's next effect: the recorded cancel is read before each tool
call, not only at a step's start."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from streams.agent_store import RunStore
from tests.connected.test_agent_runs import (
    bank_effects,
    call,
    create,
    marker,
    script,
    wait,
)

pytestmark = pytest.mark.connected


def test_a_cancel_whose_notice_was_lost_stops_the_turns_next_effect(
    make_fleet: Callable[..., Fleet],
) -> None:
    # One turn: wait, then pay. While the wait runs, a cancel is stored and its
    # notice never sent: the payment must not go ahead. It used to, and the run
    # was cancelled only at its next step. (A step may take a minute here: the
    # 6 s wait is the test's window to store the cancel, however loaded the box.)
    fleet = make_fleet(workers=1, agents=1, agent_args=["--step-timeout", "60"])
    m = marker()
    wait_then_pay = {
        "tool_calls": call("sleep", {"seconds": 6}, "c_wait")["tool_calls"]
        + call("transfer", {"from": "alice", "to": "bob", "amount": 3}, "c_pay")["tool_calls"]
    }
    script(fleet, ("user", m, wait_then_pay), ("tool", m, {"content": "Paid."}))
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    with httpx.Client(base_url=fleet.base_url, headers=headers, timeout=30) as api:
        run_id = create(api, m, ["sleep", "transfer"])["id"]
        end = time.monotonic() + 30

        def calls_stored() -> bool:
            messages = api.get(f"/v1/runs/{run_id}").json()["messages"]
            return any(x.get("tool_calls") for x in messages)

        while not calls_stored():  # then the wait runs
            assert time.monotonic() < end, "the turn's calls never stored"
            time.sleep(0.02)

        async def cancel_without_notice() -> None:
            nc = await fleet.connect()
            try:
                await (await RunStore.open(nc)).request_cancel(run_id, "by a test")
            finally:
                await nc.close()

        asyncio.run(cancel_without_notice())
        run = wait(api, run_id, timeout=60)
    assert run["status"] == "cancelled", run
    assert bank_effects(fleet, run_id) == []

"""Revoking an API key stops the agent runs it started: one parked on an
approval and one inside a long tool call end ``cancelled`` at once, not at their
deadlines (they ran on for up to a day: the executor never looked at the key
again). A run of another key of the tenant goes on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from streams.agent import Budget, Run, new_run_id
from streams.agent_store import RunStore
from tests.connected.test_agent_runs import bank_effects, call, create, marker, script, wait
from tests.waits import until_sync

pytestmark = pytest.mark.connected

REVOKED = "its API key was revoked"


def test_revoking_a_key_cancels_its_runs_and_no_other(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1, agents=1, agent_args=["--step-timeout", "120"])
    with fleet.admin() as admin:
        doomed = admin.create_key(fleet.spec.tenant, "doomed")
    parked, sleeping, other = marker(), marker(), marker()
    script(
        fleet,
        ("user", parked, call("payout", {"to": "x", "amount": 1})),
        ("user", sleeping, call("sleep", {"seconds": 300})),
        ("user", other, call("sleep", {"seconds": 2})),
        ("tool", other, {"content": "Slept."}),
    )
    bearer = {"Authorization": f"Bearer {doomed['api_key']}"}
    # The tenant's other key reads the runs (the revoked one may no longer).
    reader = {"Authorization": f"Bearer {fleet.api_key}"}
    with (
        httpx.Client(base_url=fleet.base_url, headers=bearer, timeout=30) as api,
        httpx.Client(base_url=fleet.base_url, headers=reader, timeout=30) as mine,
    ):
        on_approval = create(api, parked, ["payout"], timeout=3600)["id"]
        in_sleep = create(api, sleeping, ["sleep"], timeout=3600)["id"]
        untouched = create(mine, other, ["sleep"])["id"]
        assert wait(api, on_approval, {"awaiting_approval"})["status"] == "awaiting_approval"

        def sleeping_now() -> bool:
            return len(api.get(f"/v1/runs/{in_sleep}").json()["messages"]) >= 2

        asyncio.run(until_sync(sleeping_now, "the run inside its 300 s sleep"))

        with fleet.admin() as admin:
            revoked = admin.revoke_key(doomed["key"]["key_id"])
        assert revoked["key"]["revoked"] is True
        assert revoked["runs_cancelled"] == 2

        for run_id in (on_approval, in_sleep):
            run = wait(mine, run_id, timeout=30)  # not their hour-long deadlines
            assert run["status"] == "cancelled", run
            assert run["reason"] == REVOKED
        assert bank_effects(fleet, on_approval) == []
        assert wait(mine, untouched, timeout=30)["status"] == "completed"

        # Revoked again (a retry after a 503): nothing left to stop.
        with fleet.admin() as admin:
            assert admin.revoke_key(doomed["key"]["key_id"])["runs_cancelled"] == 0

        # A gateway that still had the key cached (up to --key-cache-s) creates a
        # run just after the revocation: its first step finds the key's cancel.
        late = asyncio.run(create_as_a_gateway(fleet, doomed["key"]["key_id"], parked))
        run = wait(mine, late, timeout=30)
        assert run["status"] == "cancelled", run
        assert run["reason"] == REVOKED
        assert bank_effects(fleet, late) == []


async def create_as_a_gateway(fleet: Fleet, key_id: str, text: str) -> str:
    """A run of ``key_id``'s stored and nudged as the runs API does (gateway/runs/service.py)."""
    nc = await fleet.connect()
    try:
        store = await RunStore.open(nc)
        run = Run(
            id=new_run_id(), tenant=fleet.spec.tenant, org=fleet.spec.tenant, key_id=key_id,
            model="sim-8b", deadline=time.time() + 3600, budget=Budget(),
            tools=("payout",), messages=[{"role": "user", "content": text}],
        )  # fmt: skip
        await store.index_run(run)
        await store.nudge(run.id, 0, "start")
        await store.create(run)
        return run.id
    finally:
        await nc.close()

"""A sub-agent whose effect ended ambiguous ends its parent ambiguous too: the
parent's model never reads it as an ordinary error (it could spawn another
sub-agent, or pay itself, and the money would move twice). The executor kills
itself after the child's payment ran and before its outcome was recorded
(``--crash-at after_effect:1``); a successor finds the intent without an outcome,
and ``transfer_unreconciled`` has no way to ask the bank."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.connected.test_agent_runs import (
    TERMINAL,
    bank_effects,
    call,
    create,
    marker,
    script,
)

pytestmark = pytest.mark.connected

PAY = {"from": "alice", "to": "bob", "amount": 4}


def test_a_child_that_ends_ambiguous_ends_its_parent_ambiguous(
    make_fleet: Callable[..., Fleet], tmp_path: Path
) -> None:
    crashes = tmp_path / "crashes.jsonl"
    fleet = make_fleet(
        workers=1,
        agents=1,
        agent_args=["--crash-at", "after_effect:1", "--crash-log", str(crashes), "--lease", "1.5"],
    )
    parent_m, child_m = marker(), marker()
    spawn = call(
        "spawn_agent", {"task": f"{child_m}: pay bob 4", "tools": ["transfer_unreconciled"]}
    )
    script(
        fleet,
        ("user", parent_m, spawn),
        # What the parent's model would do with an error: pay itself.
        ("tool", parent_m, call("transfer_unreconciled", PAY, "call_2")),
        ("user", child_m, call("transfer_unreconciled", PAY)),
        ("tool", child_m, {"content": "paid"}),
    )
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    with httpx.Client(base_url=fleet.base_url, headers=headers, timeout=30) as api:
        run_id = create(api, parent_m, ["spawn_agent", "transfer_unreconciled"])["id"]
        end = time.monotonic() + 60
        reaped: set[int] = set()
        while (run := api.get(f"/v1/runs/{run_id}").json())["status"] not in TERMINAL:
            assert time.monotonic() < end, run
            for agent in list(fleet.agents):  # one that killed itself: a successor
                if agent.proc.poll() is not None and agent.proc.pid not in reaped:
                    reaped.add(agent.proc.pid)
                    fleet.start_agent(wait=False)
            time.sleep(0.05)
        (child_id,) = run["children"]
        child = api.get(f"/v1/runs/{child_id}").json()
    assert crashes.read_text().count('"after_effect"') == 1
    assert child["status"] == "ambiguous", child
    assert run["status"] == "ambiguous", run
    assert run["ambiguous_key"] == child["ambiguous_key"]
    assert run["ambiguous_key"].startswith(f"{child_id}/")
    assert child_id in run["reason"]
    # The one payment, the child's; the parent paid nothing.
    assert len(bank_effects(fleet, child_id)) == 1
    assert bank_effects(fleet, run_id) == []

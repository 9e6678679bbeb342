"""An effectful tool call that takes longer than the executor's step timeout
runs to its outcome: the stuck-step watchdog waits for it (the call is bounded by
its tool's own timeout) instead of cutting it half-way, which left the effect
done, its outcome unrecorded, and the run ``failed`` as stuck."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.connected.test_agent_runs import call, create, marker, script, wait

pytestmark = pytest.mark.connected


def test_an_effect_longer_than_the_step_timeout_runs_to_its_outcome(
    make_fleet: Callable[..., Fleet], tmp_path: Path
) -> None:
    fleet = make_fleet(
        workers=1,
        agents=1,
        agent_args=["--step-timeout", "5", "--tools-module", "tests.agent_tools:slow_effects"],
    )
    book = tmp_path / "book.txt"
    m = marker()
    script(
        fleet,
        # Past the step's 5 s on its own (the model call before it is well inside).
        ("user", m, call("slow_effect", {"book": str(book), "seconds": 8})),
        ("tool", m, {"content": "written"}),
    )
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    with httpx.Client(base_url=fleet.base_url, headers=headers, timeout=30) as api:
        run = wait(api, create(api, m, ["slow_effect"])["id"], timeout=30)
    assert run["status"] == "completed", run
    assert run["result"] == "written"
    assert book.read_text().splitlines() == [f"{run['id']}/0/call_1"]  # once

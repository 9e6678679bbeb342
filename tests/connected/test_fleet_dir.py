"""A fleet's directory (its stores' data, logs and credentials, secrets among
them) goes with the fleet unless it is kept for a look (jetserve/fleet.py)."""

from __future__ import annotations

import shutil

import pytest

from jetserve.fleet import Fleet, FleetSpec

pytestmark = pytest.mark.connected


def test_a_stopped_fleet_removes_its_directory_unless_kept() -> None:
    spec = FleetSpec(workers=1, profile="fast")
    gone = Fleet(spec).start()
    assert (gone.workdir / "gateway0.log").exists()
    gone.stop()
    assert not gone.workdir.exists()
    assert gone.stopped_violations == []  # read from the bus's log before it went

    kept = Fleet(spec).start()
    try:
        kept.stop(keep=True)  # a failed test's fleet, or a `jetserve up` whose process died
        assert (kept.workdir / "gateway0.log").exists()
    finally:
        shutil.rmtree(kept.workdir)


def test_a_fleet_left_by_an_exception_is_kept() -> None:
    with pytest.raises(RuntimeError), Fleet(FleetSpec(workers=1, profile="fast")) as fleet:
        raise RuntimeError("the test failed inside the fleet")
    try:
        assert (fleet.workdir / "gateway0.log").exists()
    finally:
        shutil.rmtree(fleet.workdir)

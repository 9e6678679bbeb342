"""No secret on a command line: ``ps`` (``/proc/<pid>/cmdline``) shows every
process's arguments to every user of the machine. A fleet with an agent
executor runs every kind of process (NATS, Redis, simulator, gateway, worker,
executor); none of them, nor anything they started, carries the admin token or
the key secret in its arguments. Those reach the gateway as files, 0600."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected


def sessions(sids: set[int]) -> dict[int, bytes]:
    """The command lines of every process in the sessions ``sids`` (each fleet
    member leads its own session, so its descendants are found too)."""
    found: dict[int, bytes] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # After the command's name (which may hold spaces and parentheses):
            # state, ppid, pgrp, session.
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) in sids:
                found[int(proc.name)] = (proc / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended while we looked: it has no command line any more
    return found


def test_no_secret_is_on_any_command_line(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=1, agents=1)
    procs = [p for p in (*fleet.gateways, *fleet.workers, *fleet.agents, fleet.sim) if p]
    services = [s for s in (fleet.redis, *fleet.nats_nodes) if s]
    members = {p.proc.pid: p.args for p in procs} | {s.proc.pid: s.args for s in services}
    assert len(members) == 6  # nats, redis, sim, gateway, worker, agent
    assert all(p.proc.poll() is None for p in procs)
    secrets = {"admin token": fleet.admin_token, "key secret": fleet.key_secret}

    cmdlines = sessions(set(members))
    assert set(members) <= set(cmdlines)  # every member was read
    for pid, cmdline in cmdlines.items():
        for what, secret in secrets.items():
            assert secret.encode() not in cmdline, f"the {what} is in pid {pid}'s arguments"
    for pid, args in members.items():  # and in what the fleet itself would log
        for what, secret in secrets.items():
            assert all(secret not in a for a in args), f"the {what} is in pid {pid}'s args"

    for name in ("JETSERVE_ADMIN_TOKEN", "JETSERVE_KEY_SECRET"):
        path = Path(fleet.secret_env[f"{name}_FILE"])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert fleet.secret_env[name] == ""  # an inherited value cannot win over the file

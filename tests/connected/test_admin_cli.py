"""The admin CLI, as a user runs it, against a real gateway's admin API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected


def cli(fleet: Fleet, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "JETSERVE_ADMIN_URL": fleet.admin_url,
        "JETSERVE_ADMIN_TOKEN": fleet.admin_token if token is None else token,
    }
    return subprocess.run(
        [sys.executable, "-m", "jetserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def api_key_of(out: str) -> str:
    line = next(x for x in out.splitlines() if x.startswith("api_key: "))
    return line.split()[1]


def test_tenant_key_limits_ledger_lifecycle(fleet: Fleet, tmp_path: Path) -> None:
    assert cli(fleet, "tenants", "create", "initech", "--org", "initrode").returncode == 0
    shown = json.loads(cli(fleet, "tenants", "list").stdout)
    assert any(t["id"] == "initech" and t["org"] == "initrode" for t in shown)

    created = cli(fleet, "keys", "create", "--tenant", "initech", "--models", "sim-8b")
    assert created.returncode == 0, created.stderr
    key = api_key_of(created.stdout)
    key_id = json.loads(created.stdout.split("api_key: ")[0])["key_id"]
    listed = json.loads(cli(fleet, "keys", "list", "--tenant", "initech").stdout)
    assert [k["key_id"] for k in listed] == [key_id]
    assert key not in json.dumps(listed)  # only a prefix and the hash are kept

    body = {"model": "sim-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    chat = f"{fleet.base_url}/v1/chat/completions"
    assert (
        httpx.post(chat, json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    )

    limits = cli(
        fleet,
        "limits",
        "set",
        "--level",
        "tenant",
        "--id",
        "initech",
        "--budget-usd",
        "0.000001",
        "--period",
        "month",
        "--rpm",
        "100",
    )
    assert limits.returncode == 0, limits.stderr
    over = httpx.post(chat, json=body, headers={"Authorization": f"Bearer {key}"})
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "budget_exceeded"
    shown_limits = json.loads(
        cli(fleet, "limits", "show", "--level", "tenant", "--id", "initech").stdout
    )
    assert shown_limits["rpm"] == 100
    assert shown_limits["spent_micros"] > 0

    rotated = cli(fleet, "keys", "rotate", key_id)
    new_key = api_key_of(rotated.stdout)
    assert new_key != key
    revoked = json.loads(cli(fleet, "tenants", "show", "initech").stdout)["keys"]
    assert {k["key_id"]: k["revoked"] for k in revoked}[key_id] is True

    out = tmp_path / "ledger.jsonl"
    exported = cli(fleet, "ledger", "--tenant", "initech", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["policy"] for r in records} == {"admitted", "rejected:budget"}
    assert all(r["tenant"] == "initech" for r in records)


def test_admin_api_needs_its_own_credential(fleet: Fleet) -> None:
    denied = cli(fleet, "tenants", "list", token="not-the-token")
    assert denied.returncode != 0
    assert "401" in denied.stderr
    # A tenant API key is not an admin credential, and the public port has no admin routes.
    r = httpx.get(
        f"{fleet.base_url}/admin/tenants", headers={"Authorization": f"Bearer {fleet.api_key}"}
    )
    assert r.status_code == 404

"""The admin CLI, as a user runs it, against a real gateway's admin API."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jetserve.commands.admin_client import AdminError
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


def test_key_management_keeps_keys_their_own_tenants_and_limits(fleet: Fleet) -> None:
    """An operator's api_key that was already a key moved that key to another tenant
    (201, silently: its old id then revoked the new record); a rotated key lost its
    key-level limits (a key held at a budget of 0 went on spending); two first
    tenants of one new org at once: one got 409 "Org exists"."""
    body = {"model": "sim-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    chat = f"{fleet.base_url}/v1/chat/completions"
    plaintext = "sk-operator-chosen-0123456789abcdef"
    with fleet.admin() as admin:
        admin.create_tenant("globex", org="globex")
        admin.create_tenant("acme", org="acme")
        first = admin.create_key("globex", api_key=plaintext)
        with pytest.raises(AdminError) as taken:
            admin.create_key("acme", api_key=plaintext)
        assert taken.value.status == 409
        assert [k["tenant"] for k in admin.list_keys("globex")] == ["globex"]
        assert admin.list_keys("acme") == []

        key_id = first["key"]["key_id"]
        admin.set_limits("key", key_id, budget_micros=0, period="total", rpm=1)
        held = httpx.post(chat, json=body, headers={"Authorization": f"Bearer {plaintext}"})
        assert held.status_code == 429
        rotated = admin.rotate_key(key_id)
        new_id = rotated["key"]["key_id"]
        old_limits, new_limits = admin.get_limits("key", key_id), admin.get_limits("key", new_id)
        for field in ("budget_micros", "period", "rpm"):
            assert new_limits[field] == old_limits[field], (field, new_limits)
        headers = {"Authorization": f"Bearer {rotated['api_key']}"}
        assert httpx.post(chat, json=body, headers=headers).status_code == 429

    async def two_first_tenants() -> list[int]:
        async with httpx.AsyncClient(
            base_url=fleet.admin_url, headers={"Authorization": f"Bearer {fleet.admin_token}"}
        ) as c:
            made = await asyncio.gather(
                *(c.post("/admin/tenants", json={"id": t, "org": "neworg"}) for t in ("t-1", "t-2"))
            )
        return [r.status_code for r in made]

    assert asyncio.run(two_first_tenants()) == [201, 201]

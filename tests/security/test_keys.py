"""API keys, the key secret, the admin token and /metrics, through a real fleet:
operator-chosen keys have a minimum length, keys are stored as HMAC-SHA-256
under the fleet's key secret (a legacy SHA-256 record is upgraded on first
use), a gateway without the secret refuses to start, the admin CLI takes its
token from the environment or a file only, and /metrics lives on its own port
and names no tenant by default."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from gateway.tenancy import keys as server_keys
from jetserve.cli import build_parser
from jetserve.commands import keys as cli_keys
from jetserve.commands.admin_client import AdminError
from jetserve.fleet import Fleet
from jetserve.services import free_port

pytestmark = pytest.mark.connected

BODY = {"model": "sim-8b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
# What a gateway needs from the environment besides the key secret; cleared so
# that the test's own environment cannot leak a secret into the child.
SECRET_VARS = ("JETSERVE_KEY_SECRET", "JETSERVE_KEY_SECRET_FILE")


@pytest.fixture
def store(fleet: Fleet) -> Iterator[redis.Redis]:
    """The fleet's Redis, as the fleet's most privileged user (the one place
    that knows how this test reaches Redis)."""
    client = redis.Redis.from_url(fleet.redis_url)
    try:
        yield client
    finally:
        client.close()


def raw(store: redis.Redis, name: str) -> bytes | None:
    value = store.get(name)
    assert value is None or isinstance(value, bytes)  # no decode_responses: bytes
    return value


def models(fleet: Fleet, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{fleet.base_url}/v1/models", headers=headers, timeout=10).status_code


def keyed(fleet: Fleet, key: str) -> str:
    return hmac.new(fleet.key_secret.encode(), key.encode(), hashlib.sha256).hexdigest()


# -- operator-chosen keys -----------------------------------------------------------


def test_an_operator_key_needs_32_characters(fleet: Fleet) -> None:
    short, enough = "k" * 31, "sk-op-" + "x" * 26
    assert (len(short), len(enough)) == (31, 32)
    with fleet.admin() as admin, pytest.raises(AdminError) as refused:
        admin.create_key(fleet.spec.tenant, "short", api_key=short)
    assert refused.value.status == 400
    body = json.loads(str(refused.value).split(": ", 1)[1])
    assert body["error"]["param"] == "api_key"
    assert models(fleet, short) == 401  # nothing was stored
    with fleet.admin() as admin:
        created = admin.create_key(fleet.spec.tenant, "enough", api_key=enough)
    assert created["api_key"] == enough
    assert models(fleet, enough) == 200


def test_generated_keys_are_long_and_unknown_actions_refused(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        created = admin.create_key(fleet.spec.tenant, "generated")
        with pytest.raises(AdminError) as refused:
            admin.create_key(fleet.spec.tenant, "root", {"actions": ["root"]})
    assert len(created["api_key"]) >= server_keys.MIN_KEY_CHARS
    assert created["key"]["scopes"].get("actions", ["inference"]) == ["inference"]
    assert refused.value.status == 400


def test_a_key_stored_before_actions_may_infer_but_not_approve() -> None:
    old = b'{"key_id": "key_1", "tenant": "t", "scopes": {"models": ["sim-8b"]}}'
    record = msgspec.json.decode(old, type=server_keys.KeyRecord)
    assert record.scopes.may("inference")
    assert not record.scopes.may("approve")
    record.scopes.check(model="sim-8b", cls="interactive")  # inference still allowed


def test_the_cli_mirrors_the_servers_rules() -> None:
    """The CLI does not import the gateway: its copies must agree."""
    assert cli_keys.ACTIONS == server_keys.ACTIONS
    assert cli_keys.MIN_KEY_CHARS == server_keys.MIN_KEY_CHARS


# -- how keys are stored ---------------------------------------------------------------


def test_a_key_is_stored_keyed_not_as_its_sha256(fleet: Fleet, store: redis.Redis) -> None:
    key = fleet.api_key
    digest = raw(store, f"jetserve:keyid:{fleet.key_id}")
    assert digest is not None
    assert digest.decode() != hashlib.sha256(key.encode()).hexdigest()
    assert digest.decode() == keyed(fleet, key)  # HMAC-SHA-256 under the fleet's secret
    assert not store.exists(f"jetserve:apikey:{hashlib.sha256(key.encode()).hexdigest()}")
    dump = b"".join(raw(store, k) or b"" for k in store.scan_iter("jetserve:apikey:*"))
    assert key.encode() not in dump
    assert fleet.key_secret.encode() not in dump


def test_a_legacy_sha256_key_works_once_and_is_upgraded(fleet: Fleet, store: redis.Redis) -> None:
    """A record written before keyed hashing (as the old gateway did) keeps
    working, and its first use moves it under the keyed digest."""
    key, key_id = "sk-legacy-" + os.urandom(16).hex(), "key_legacy" + os.urandom(4).hex()
    legacy = hashlib.sha256(key.encode()).hexdigest()
    record = {"key_id": key_id, "tenant": fleet.spec.tenant, "org": fleet.spec.tenant}
    store.set(f"jetserve:apikey:{legacy}", json.dumps(record))
    store.set(f"jetserve:keyid:{key_id}", legacy)
    store.sadd(f"jetserve:tenantkeys:{fleet.spec.tenant}", key_id)
    assert models(fleet, key) == 200
    assert not store.exists(f"jetserve:apikey:{legacy}")
    assert raw(store, f"jetserve:keyid:{key_id}") == keyed(fleet, key).encode()
    assert store.exists(f"jetserve:apikey:{keyed(fleet, key)}")
    with fleet.admin() as admin:
        assert admin.revoke_key(key_id)["key"]["revoked"] is True
    revoked = json.loads(raw(store, f"jetserve:apikey:{keyed(fleet, key)}") or b"{}")
    assert revoked["revoked"] is True  # the revocation found the moved record


# -- the key secret and the admin token -------------------------------------------------


def gateway(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SECRET_VARS}
    return subprocess.run(
        [sys.executable, "-m", "jetserve", "gateway", "--port", str(free_port()), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_gateway_refuses_to_start_without_a_key_secret() -> None:
    out = gateway({})
    assert out.returncode == 2, out.stderr
    assert "JETSERVE_KEY_SECRET_FILE" in out.stderr
    assert "JETSERVE_KEY_SECRET" in out.stderr
    assert "--insecure" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_unreadable_key_secret_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    out = gateway({"JETSERVE_KEY_SECRET_FILE": str(missing)})
    assert out.returncode == 2, out.stderr
    assert f"JETSERVE_KEY_SECRET_FILE={missing}" in out.stderr


def admin_cli(fleet: Fleet, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("JETSERVE_ADMIN_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "jetserve", *args],
        env={**base, "JETSERVE_ADMIN_URL": fleet.admin_url, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_admin_cli_takes_its_token_from_a_file_never_a_flag(fleet: Fleet) -> None:
    token_file = fleet.secret_env["JETSERVE_ADMIN_TOKEN_FILE"]
    env = {"JETSERVE_ADMIN_TOKEN_FILE": token_file}
    created = admin_cli(
        fleet, env, "keys", "create", "--tenant", fleet.spec.tenant, "--scope", "approve"
    )
    assert created.returncode == 0, created.stderr
    record = json.loads(created.stdout.split("api_key: ")[0])
    assert record["scopes"]["actions"] == ["approve"]
    flag = admin_cli(fleet, env, "tenants", "list", "--admin-token", "not-a-real-token")
    assert flag.returncode == 2
    assert "unrecognized arguments: --admin-token" in flag.stderr
    none = admin_cli(fleet, {}, "tenants", "list")
    assert none.returncode == 2
    assert "JETSERVE_ADMIN_TOKEN_FILE" in none.stderr


# -- /metrics ---------------------------------------------------------------------------


def test_metrics_are_on_their_own_port_and_name_no_tenant(fleet: Fleet) -> None:
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    chat = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=BODY, headers=headers)
    assert chat.status_code == 200, chat.text
    public = httpx.get(f"{fleet.base_url}/metrics")
    assert public.status_code == 404
    assert public.json()["error"]["code"] == "not_found"
    scraped = httpx.get(fleet.gateway_metrics_urls[0])
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    assert 'jetserve_gateway_tenant_requests_total{outcome="ok",tenant="other"}' in scraped.text
    assert f'tenant="{fleet.spec.tenant}"' not in scraped.text
    assert fleet.gateway_metrics_urls[0].startswith("http://127.0.0.1:")


def test_the_metrics_listener_is_off_and_loopback_by_default() -> None:
    args = build_parser().parse_args(["gateway"])
    assert (args.metrics_port, args.metrics_host, args.metrics_tenants) == (None, "127.0.0.1", "")
    assert args.allow_self_approval is False

"""The permission table (streams/auth.py), the credential files
(jetserve/credentials.py) and the NATS ingress's target rule
(gateway/ingress/nats_targets.py), without servers: the servers' side is
tests/security/test_bus.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gateway.ingress.nats_targets import NotOwnInbox, check_target, inbox_tenant
from jetserve.credentials import Credentials, generate, public_key
from streams.auth import Role, inbox_prefix, permissions, tenant_of_inbox
from streams.routes import ROUTES_BUCKET
from streams.subjects import KV_INDEX_SUBJECT


def _covers(patterns: tuple[str, ...], subject: str) -> bool:
    """Whether a NATS subject pattern list matches ``subject`` (``*``, ``>``)."""
    want = subject.split(".")
    for pattern in patterns:
        toks = pattern.split(".")
        for i, tok in enumerate(toks):
            if tok == ">":
                if len(want) > i:
                    return True
                break
            if i >= len(want) or (tok != "*" and tok != want[i]):
                break
        else:
            if len(toks) == len(want):
                return True
    return False


def test_a_service_sends_on_the_api_and_hears_only_its_own_tenant() -> None:
    p = permissions(Role.SERVICE, "acme")
    assert p.publish == ("jetserve.api.>",)
    assert _covers(p.subscribe, "_INBOX.tenant.acme.x1")
    assert _covers(p.subscribe, "jetserve.run.acme.run_1")
    for subject in ("_INBOX.tenant.beta.x1", "jetserve.run.beta.run_1", "jetserve.reply.acme.g.r"):
        assert not _covers(p.subscribe, subject), subject


def test_a_worker_cannot_touch_routes_or_the_api() -> None:
    p = permissions(Role.WORKER)
    for subject in (
        f"$KV.{ROUTES_BUCKET}.m",
        f"$JS.API.STREAM.UPDATE.KV_{ROUTES_BUCKET}",
        "jetserve.api.chat",
        "jetserve.req.interactive",
        "$JS.API.CONSUMER.MSG.NEXT.JETSERVE_AGENT.agent-executor",
    ):
        assert not _covers(p.publish, subject), subject
    assert not _covers(p.subscribe, "jetserve.api.chat")
    assert _covers(p.publish, "$JS.API.CONSUMER.MSG.NEXT.JETSERVE_REQ.workers-interactive")
    assert _covers(p.publish, "jetserve.reply.acme.gw1.r1")


def test_workers_publish_the_kv_index_and_gateways_only_hear_it() -> None:
    worker, gateway = permissions(Role.WORKER), permissions(Role.GATEWAY)
    assert _covers(worker.publish, KV_INDEX_SUBJECT)
    assert not _covers(worker.subscribe, KV_INDEX_SUBJECT)
    assert _covers(gateway.subscribe, KV_INDEX_SUBJECT)
    assert not _covers(gateway.publish, KV_INDEX_SUBJECT)
    for role in (Role.SERVICE, Role.TOOLS, Role.AGENT):
        p = permissions(role, "acme" if role is Role.SERVICE else None)
        assert not _covers(p.publish, KV_INDEX_SUBJECT), role
        assert not _covers(p.subscribe, KV_INDEX_SUBJECT), role


@pytest.mark.parametrize("role", [r for r in Role if r is not Role.ADMIN])
def test_only_the_operator_deletes_or_purges_streams(role: Role) -> None:
    p = permissions(role, "acme" if role is Role.SERVICE else None)
    for op in ("DELETE", "PURGE"):
        assert not _covers(p.publish, f"$JS.API.STREAM.{op}.JETSERVE_REQ"), (role, op)
    assert ">" not in p.publish
    assert ">" not in p.subscribe


def test_inboxes_are_per_role_and_per_tenant() -> None:
    prefixes = {inbox_prefix(r) for r in Role if r is not Role.SERVICE}
    prefixes |= {inbox_prefix(Role.SERVICE, t) for t in ("a", "b")}
    assert len(prefixes) == len(Role) - 1 + 2
    assert tenant_of_inbox("_INBOX.tenant.acme.abc") == "acme"
    assert tenant_of_inbox("_INBOX.gateway.abc") is None
    with pytest.raises(ValueError, match="safe id"):
        inbox_prefix(Role.SERVICE, "a.b")


@pytest.mark.parametrize(
    ("subject", "tenant"),
    [
        ("_INBOX.tenant.acme.x.1", "acme"),
        ("_INBOX.tenant.acme.*", None),
        ("_INBOX.tenant.acme.>", None),
        ("_INBOX.tenant.acme..x", None),
        ("_INBOX.tenant.acme x", None),
        ("$JS.API.STREAM.DELETE.JETSERVE_REQ", None),
        ("jetserve.req.batch", None),
        ("", None),
        (None, None),
        ("_INBOX.tenant.acme." + "x" * 300, None),
    ],
)
def test_only_literal_tenant_inboxes_are_targets(subject: str | None, tenant: str | None) -> None:
    assert inbox_tenant(subject) == tenant


def test_a_target_of_another_tenant_is_refused() -> None:
    check_target("_INBOX.tenant.acme.r", "acme", "reply")
    with pytest.raises(NotOwnInbox) as info:
        check_target("_INBOX.tenant.beta.r", "acme", "reply")
    assert info.value.status == 403
    assert info.value.code == "reply_target_forbidden"


def test_credentials_are_private_files_and_servers_get_no_secret(tmp_path: Path) -> None:
    creds = generate(tmp_path / "c", ("acme",))
    assert stat.S_IMODE(creds.root.stat().st_mode) == 0o700
    conf, acl = creds.nats_conf.read_text(), creds.redis_acl.read_text()
    for role in (Role.GATEWAY, Role.WORKER, Role.AGENT, Role.ADMIN, Role.TOOLS):
        path = creds.seed_file(role)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert creds.seed(role) not in conf
        assert public_key(creds.seed(role)) in conf
    assert public_key(creds.seed(Role.SERVICE, "acme")) in conf
    for user in ("gateway", "agent", "admin"):
        assert creds.redis_password(user) not in acl
    assert "user default off" in acl
    # Run again with another tenant: the old seeds stay, the new tenant joins.
    seed = creds.seed(Role.GATEWAY)
    again = generate(creds.root, ("beta",))
    assert again.seed(Role.GATEWAY) == seed
    assert Credentials.load(creds.root).tenants == ("acme", "beta")
    assert public_key(again.seed(Role.SERVICE, "acme")) in again.nats_conf.read_text()

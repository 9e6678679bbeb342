"""``jetserve credentials`` and ``jetserve nats-config``: a deployment's bus
credentials (jetserve/credentials.py), as files or as Kubernetes Secrets."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from jetserve.credentials import (
    REDIS_USERS,
    Credentials,
    generate,
    nats_authorization,
    publish_server_files,
)
from streams.auth import Role

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    c = sub.add_parser(
        "credentials",
        allow_abbrev=False,
        help="generate one NATS nkey and one Redis ACL user per role (into --dir)",
    )
    c.add_argument("--dir", required=True, type=Path, help="where the files go (mode 0700)")
    c.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant whose services get a NATS credential (repeatable)",
    )
    c.add_argument(
        "--servers-dir",
        type=Path,
        default=None,
        help="also copy nats-auth.conf and redis.acl (no secret in them) here, readable "
        "by every user: for servers running as users of their own",
    )
    c.add_argument(
        "--k8s-secrets",
        metavar="NAMESPACE",
        default=None,
        help="also print them as Kubernetes Secrets (kubectl apply -f -)",
    )
    c.set_defaults(func=_credentials)
    n = sub.add_parser(
        "nats-config",
        allow_abbrev=False,
        help="print the nats-server authorization block for the credentials in --dir",
    )
    n.add_argument("--dir", required=True, type=Path)
    n.set_defaults(func=_nats_config)


def _credentials(args: argparse.Namespace) -> int:
    creds = generate(args.dir, tuple(args.tenant))
    nats_conf, acl = creds.nats_conf, creds.redis_acl
    if args.servers_dir is not None:
        nats_conf, acl = publish_server_files(creds, args.servers_dir)
    if args.k8s_secrets is not None:
        print(k8s_secrets(creds, args.k8s_secrets))
        return 0
    print(f"nats-server:  -c {nats_conf}   (public keys only)")
    print(f"redis-server: --aclfile {acl}   (password hashes only)")
    for role in (Role.GATEWAY, Role.WORKER, Role.AGENT, Role.ADMIN, Role.TOOLS):
        print(f"{role.value:>8}: JETSERVE_NATS_SEED_FILE={creds.seed_file(role)}")
    for tenant in creds.tenants:
        print(f"service {tenant}: JETSERVE_NATS_SEED_FILE={creds.seed_file(Role.SERVICE, tenant)}")
    for user in REDIS_USERS:
        path = creds.redis_password_file(user.name)
        print(f"redis {user.name}: JETSERVE_REDIS_PASSWORD_FILE={path}")
    for name, value in creds.gateway_env().items():
        print(f"gateway: {name}={value}")
    return 0


def _nats_config(args: argparse.Namespace) -> int:
    print(nats_authorization(Credentials.load(args.dir).public_keys()), end="")
    return 0


def k8s_secrets(creds: Credentials, namespace: str) -> str:
    """One Secret per role (its seed and, where it has one, its Redis password;
    the gateway's also its ``key_secret`` and ``admin_token``), and the servers'
    files (no secret in them, but kept beside the rest)."""

    def secret(
        name: str, files: dict[str, str], annotations: dict[str, str] | None = None
    ) -> dict[str, object]:
        data = {k: base64.b64encode(v.encode()).decode() for k, v in files.items()}
        meta: dict[str, object] = {"name": name, "namespace": namespace}
        if annotations:
            meta["annotations"] = annotations
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": data}

    redis_of = {"gateway": "gateway", "agent": "agent", "admin": "admin"}
    docs = []
    for role in (Role.GATEWAY, Role.WORKER, Role.AGENT, Role.ADMIN, Role.TOOLS):
        files = {"nats.nk": creds.seed(role)}
        if role.value in redis_of:
            files["redis.password"] = creds.redis_password(redis_of[role.value])
        if role is Role.GATEWAY:
            files["key_secret"] = creds.key_secret()
            files["admin_token"] = creds.admin_token()
        docs.append(secret(f"jetserve-{role.value}", files))
    for tenant in creds.tenants:
        seed = {"nats.nk": creds.seed(Role.SERVICE, tenant)}
        docs.append(secret(service_secret_name(tenant), seed, {"jetserve.dev/tenant": tenant}))
    servers = {
        "nats-auth.conf": creds.nats_conf.read_text(),
        "redis.acl": creds.redis_acl.read_text(),
    }
    docs.append(secret("jetserve-bus-auth", servers))
    # JSON is YAML: one document per Secret.
    return "\n---\n".join(json.dumps(d, indent=2) for d in docs)


_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def service_secret_name(tenant: str) -> str:
    """The Secret of ``tenant``'s service credential: ``jetserve-service-<tenant>``
    when that is a Kubernetes name (lower case, digits, inner dashes), else the
    tenant made one (``Acme_EU`` -> ``acme-eu``) and a hash of it, so two tenants
    never share one (``Acme`` and ``acme``); the tenant is in its annotation.
    Tenant ids allow upper case and ``_``, which kubectl refused."""
    if _K8S_NAME.fullmatch(tenant):
        return f"jetserve-service-{tenant}"
    slug = re.sub(r"[^a-z0-9-]+", "-", tenant.lower()).strip("-") or "t"
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:8]
    return f"jetserve-service-{slug}-{digest}"

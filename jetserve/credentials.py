"""A deployment's credentials: one NATS nkey and one Redis ACL user per role.

``generate`` writes them into a directory (mode 0700, every secret 0600)::

    nats/<role>.nk             the role's nkey seed (service-<tenant>.nk per tenant)
    nats-auth.conf             the nats-server ``authorization`` block (public keys only)
    redis/<user>.password      the Redis ACL user's password
    redis.acl                  the redis-server ACL file (password hashes only)
    key_secret                 the gateways' API key hashing secret (JETSERVE_KEY_SECRET_FILE)
    admin_token                the admin API's token (JETSERVE_ADMIN_TOKEN_FILE)

The server-side files hold no secret: a leaked ``nats-auth.conf`` or
``redis.acl`` lets nobody in. ``jetserve nats-config`` renders the block again
from the seeds of a directory (after a tenant is added, say). The servers
usually run as users of their own, who cannot enter the 0700 directory:
``publish_server_files`` copies just those two files into a directory they can
read (compose.yml's ``bus-auth`` volume).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import nkeys

from streams.auth import Permissions, Role, inbox_prefix, permissions
from streams.connect import BusAuth
from streams.ids import is_safe_id

INTERNAL_ROLES = (Role.GATEWAY, Role.WORKER, Role.AGENT, Role.ADMIN, Role.TOOLS)


@dataclass(frozen=True)
class RedisUser:
    """A Redis ACL user: the key patterns it may touch (nothing else)."""

    name: str
    keys: tuple[str, ...]


# The gateway owns every ``jetserve:`` key (keys, tenants, limits, spend,
# idempotency, WebSocket tickets); the demo bank its own prefix; the admin user
# is the operator's (and the test suite's) look at everything.
REDIS_USERS = (
    RedisUser("gateway", ("jetserve:*",)),
    RedisUser("agent", ("demobank:*",)),
    RedisUser("admin", ("*",)),
)
# Data commands only: no CONFIG, FLUSHALL, KEYS, DEBUG, ACL, MODULE (``@dangerous``).
_REDIS_COMMANDS = "-@all +@read +@write +@keyspace +@scripting +@connection +@transaction"
# ``CLUSTER SLOTS`` (read-only: which node serves which slots) lets a cluster
# client find the primaries (streams/redis_client.py); no other CLUSTER command.
_REDIS_CLUSTER_COMMANDS = "+cluster|slots"


def _nkey_seed() -> bytes:
    seed: bytes = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    return seed


def public_key(seed: str | bytes) -> str:
    raw = seed.encode() if isinstance(seed, str) else seed
    key: bytes = nkeys.from_seed(bytearray(raw)).public_key
    return key.decode()


def _write_secret(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


@dataclass(frozen=True)
class Credentials:
    """The files of one deployment's credentials (see the module docstring)."""

    root: Path
    tenants: tuple[str, ...] = field(default=())

    def seed_file(self, role: Role, tenant: str | None = None) -> Path:
        name = f"service-{tenant}" if role is Role.SERVICE else role.value
        return self.root / "nats" / f"{name}.nk"

    def redis_password_file(self, user: str) -> Path:
        return self.root / "redis" / f"{user}.password"

    @property
    def nats_conf(self) -> Path:
        return self.root / "nats-auth.conf"

    @property
    def redis_acl(self) -> Path:
        return self.root / "redis.acl"

    @property
    def key_secret_file(self) -> Path:
        """The secret every gateway replica hashes API keys under."""
        return self.root / "key_secret"

    @property
    def admin_token_file(self) -> Path:
        """The admin API's credential (the gateway keeps only its SHA-256)."""
        return self.root / "admin_token"

    def gateway_env(self) -> dict[str, str]:
        """The gateway's secrets beyond the bus: its key secret and the admin token."""
        return {
            "JETSERVE_KEY_SECRET_FILE": str(self.key_secret_file),
            "JETSERVE_ADMIN_TOKEN_FILE": str(self.admin_token_file),
        }

    def nats_env(self, role: Role, tenant: str | None = None) -> dict[str, str]:
        """What a process of ``role`` needs in its environment to reach NATS."""
        return {"JETSERVE_NATS_SEED_FILE": str(self.seed_file(role, tenant))}

    def redis_env(self, user: str) -> dict[str, str]:
        return {"JETSERVE_REDIS_PASSWORD_FILE": str(self.redis_password_file(user))}

    def bus_auth(self, role: Role, tenant: str | None = None) -> BusAuth:
        """A role's NATS credential, for a connection from this process."""
        return BusAuth(self.seed(role, tenant), inbox_prefix(role, tenant))

    def seed(self, role: Role, tenant: str | None = None) -> str:
        return self.seed_file(role, tenant).read_text().strip()

    def redis_password(self, user: str) -> str:
        return self.redis_password_file(user).read_text().strip()

    def key_secret(self) -> str:
        return self.key_secret_file.read_text().strip()

    def admin_token(self) -> str:
        return self.admin_token_file.read_text().strip()

    def add_tenant(self, tenant: str) -> Credentials:
        """A service credential for one more tenant; rewrites ``nats-auth.conf``
        (reload nats-server to let it in: ``nats-server --signal reload``)."""
        if not is_safe_id(tenant):
            raise ValueError(f"not a safe tenant id: {tenant!r}")
        path = self.seed_file(Role.SERVICE, tenant)
        if not path.exists():
            _write_secret(path, _nkey_seed())
        creds = Credentials(self.root, tuple(sorted({*self.tenants, tenant})))
        creds.nats_conf.write_text(nats_authorization(creds.public_keys()))
        return creds

    def public_keys(self) -> dict[tuple[Role, str | None], str]:
        keys: dict[tuple[Role, str | None], str] = {
            (role, None): public_key(self.seed(role)) for role in INTERNAL_ROLES
        }
        for tenant in self.tenants:
            keys[(Role.SERVICE, tenant)] = public_key(self.seed(Role.SERVICE, tenant))
        return keys

    @classmethod
    def load(cls, root: Path) -> Credentials:
        """The credentials already in ``root`` (tenants from its service seeds)."""
        tenants = sorted(p.stem.removeprefix("service-") for p in root.glob("nats/service-*.nk"))
        return cls(root, tuple(tenants))


def generate(root: Path, tenants: tuple[str, ...] = ()) -> Credentials:
    """New seeds and passwords for every role (existing files are kept: running it
    again on a deployment's directory adds what is missing and renders again)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    creds = Credentials.load(root)  # tenants added before stay in
    for role in INTERNAL_ROLES:
        if not creds.seed_file(role).exists():
            _write_secret(creds.seed_file(role), _nkey_seed())
    for user in REDIS_USERS:
        if not creds.redis_password_file(user.name).exists():
            _write_secret(creds.redis_password_file(user.name), secrets.token_urlsafe(32))
    # Kept once written: a new key secret would orphan every stored API key.
    for path in (creds.key_secret_file, creds.admin_token_file):
        if not path.exists():
            _write_secret(path, secrets.token_urlsafe(32))
    for tenant in tenants:
        creds = creds.add_tenant(tenant)
    creds.nats_conf.write_text(nats_authorization(creds.public_keys()))
    creds.redis_acl.write_text(redis_acl(creds))
    return creds


def publish_server_files(creds: Credentials, dest: Path) -> tuple[Path, Path]:
    """Copy the servers' files (``nats-auth.conf``, ``redis.acl``: no secret in
    them) into ``dest``, readable by every user: redis-server drops to a user of
    its own that cannot enter the credentials' 0700 directory. Each file is
    replaced atomically, so a server reloading it never reads half of one.
    Returns the copies' paths (nats-server's, redis-server's)."""
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)

    def copy(source: Path) -> Path:
        target, tmp = dest / source.name, dest / f".{source.name}.tmp"
        tmp.write_text(source.read_text())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        return target

    return copy(creds.nats_conf), copy(creds.redis_acl)


def _perm_block(p: Permissions) -> dict[str, object]:
    block: dict[str, object] = {
        "publish": {"allow": list(p.publish)} if p.publish else {"deny": [">"]},
        "subscribe": {"allow": list(p.subscribe)} if p.subscribe else {"deny": [">"]},
    }
    if p.allow_responses:
        block["allow_responses"] = True
    return block


def nats_authorization(keys: dict[tuple[Role, str | None], str]) -> str:
    """The nats-server ``authorization`` block (JSON is valid nats-server config)."""
    users = [
        {"nkey": key, "permissions": _perm_block(permissions(role, tenant))}
        for (role, tenant), key in sorted(keys.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
    ]
    header = (
        "# jetserve: one nkey user per role (public keys only; seeds stay with the processes)\n"
    )
    return header + "authorization " + json.dumps({"users": users}, indent=2) + "\n"


def redis_acl(creds: Credentials) -> str:
    # No anonymous access at all: the default user is off, so no connection can
    # authenticate as it. Its rules serve only Redis's own AOF-loading client,
    # which runs as that user: with none, a restart drops every MULTI/EXEC and
    # every script of several writes in the AOF (keys, limits, spend; redis/redis
    # #14541, docs/reliability.md#durability-settings).
    lines = ["user default off resetchannels ~* +@all"]
    for user in REDIS_USERS:
        digest = hashlib.sha256(creds.redis_password(user.name).encode()).hexdigest()
        patterns = " ".join(f"~{k}" for k in user.keys)
        commands = (
            "+@all"
            if user.name == "admin"
            else f"{_REDIS_COMMANDS} -@dangerous {_REDIS_CLUSTER_COMMANDS}"
        )
        lines.append(f"user {user.name} on #{digest} resetchannels {patterns} {commands}")
    return "\n".join(lines) + "\n"

"""What several subcommands share: the environment's default addresses and the
comma-separated list flags."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    # argparse's subparser action is generic only in typeshed, not at run time.
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

    from streams.auth import Role
    from streams.connect import BusAuth

DEFAULT_NATS = os.environ.get("JETSERVE_NATS_URL", "nats://127.0.0.1:4222")
DEFAULT_REDIS = os.environ.get("JETSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_CLUSTER_HELP = (
    "--redis names one node of a Redis Cluster: the client finds the others and "
    "routes by hash slot (same ACL user and password)"
)
DEFAULT_ADMIN = os.environ.get("JETSERVE_ADMIN_URL", "http://127.0.0.1:8081")
OTEL_EXPORTER = os.environ.get("JETSERVE_OTEL_EXPORTER") or None
OTEL_HELP = "export spans: otlp+http://HOST:4318 or file:///PATH (needs the otel extra)"
REPLICAS_HELP = "JetStream stream replicas (3: HA)"


def split_csv(value: str) -> tuple[str, ...]:
    """``a, b,,c`` -> ``("a", "b", "c")``."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_bus_args(p: argparse.ArgumentParser) -> None:
    """How a process authenticates to NATS and Redis: credentials come from the
    environment (JETSERVE_NATS_SEED_FILE, JETSERVE_REDIS_PASSWORD_FILE), never
    from flags; these only say where TLS files are, or that the bus is open."""
    p.add_argument(
        "--insecure",
        action="store_true",
        help=(
            "run without bus credentials and secrets: NATS and Redis open, a public "
            "development key secret (loud warning; development only)"
        ),
    )
    p.add_argument("--nats-tls-ca", default=None, help="CA bundle: verify the NATS server")
    p.add_argument("--nats-tls-cert", default=None, help="client certificate for NATS mTLS")
    p.add_argument("--nats-tls-key", default=None, help="its private key")


def bus_auth(args: argparse.Namespace, role: Role, tenant: str | None = None) -> BusAuth:
    from streams.connect import BusAuth

    return BusAuth.from_env(
        role,
        tenant=tenant,
        insecure=args.insecure,
        tls_ca=args.nats_tls_ca,
        tls_cert=args.nats_tls_cert,
        tls_key=args.nats_tls_key,
    )


def redis_password(args: argparse.Namespace, role: str) -> str | None:
    """The Redis ACL user's password (the user is the URL's), from
    JETSERVE_REDIS_PASSWORD(_FILE); missing and not --insecure: refuse to start."""
    from streams.errors import CredentialError
    from streams.secrets import read_secret

    password = read_secret("JETSERVE_REDIS_PASSWORD")
    if password is None and not args.insecure:
        raise CredentialError(
            f"no Redis credential for the {role}: set JETSERVE_REDIS_PASSWORD_FILE (or "
            "JETSERVE_REDIS_PASSWORD) and name the ACL user in the URL "
            f"(redis://{role}@host:6379/0), or pass --insecure"
        )
    return password


ENGINE_API_KEY_ENV = "JETSERVE_ENGINE_API_KEY"


def engine_api_key() -> str | None:
    """The engine's API key (a bearer token it checks), from JETSERVE_ENGINE_API_KEY
    or the file named by JETSERVE_ENGINE_API_KEY_FILE: never a flag, which every
    user of the machine reads in the worker's command line for as long as it runs."""
    from streams.secrets import read_secret

    return read_secret(ENGINE_API_KEY_ENV)

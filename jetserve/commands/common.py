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

DEFAULT_NATS = os.environ.get("JETSERVE_NATS_URL", "nats://127.0.0.1:4222")
DEFAULT_REDIS = os.environ.get("JETSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_ADMIN = os.environ.get("JETSERVE_ADMIN_URL", "http://127.0.0.1:8081")
OTEL_EXPORTER = os.environ.get("JETSERVE_OTEL_EXPORTER") or None
OTEL_HELP = "export spans: otlp+http://HOST:4318 or file:///PATH (needs the otel extra)"
REPLICAS_HELP = "JetStream stream replicas (3: HA)"


def split_csv(value: str) -> tuple[str, ...]:
    """``a, b,,c`` -> ``("a", "b", "c")``."""
    return tuple(v.strip() for v in value.split(",") if v.strip())

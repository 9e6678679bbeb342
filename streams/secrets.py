"""Secrets from the environment: a value, or a file that holds it.

``read_secret("JETSERVE_ADMIN_TOKEN")`` returns ``$JETSERVE_ADMIN_TOKEN`` or the
contents of the file named by ``$JETSERVE_ADMIN_TOKEN_FILE`` (a mounted
Kubernetes Secret, a fleet's temp dir). Never from a command-line flag: ``ps``
shows every process's arguments to every user of the machine.
"""

from __future__ import annotations

import os
from pathlib import Path

from streams.errors import SecretError


def read_secret(name: str, environ: dict[str, str] | None = None) -> str | None:
    """``$NAME``, else the stripped contents of ``$NAME_FILE``, else None."""
    env = os.environ if environ is None else environ
    value = env.get(name)
    if value:
        return value
    path = env.get(f"{name}_FILE")
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise SecretError(f"{name}_FILE={path}: {exc.strerror}") from exc
    if not text:
        raise SecretError(f"{name}_FILE={path} is empty")
    return text

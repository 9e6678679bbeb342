"""Helpers of the real-llama.cpp tier: the server handle and its readiness. Fixtures
live in conftest.py; tests import from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "bench" / "peers" / "llamacpp.sh"
STARTUP_S = 60.0  # a 3.5 MB model: a few seconds, generous for a loaded machine
CONTEXT = 1024  # the server's --n_ctx, as the vLLM tier's max-model-len


@dataclass(frozen=True)
class LlamaCppServer:
    url: str
    model: str
    startup_s: float | None = None  # None: started by someone else
    rss_mb: float | None = None
    log: Path | None = None  # its stdout and stderr, when the fixture started it

    def disconnects(self) -> int:
        """How many streams the server dropped because their client left: it prints
        "disconnected" for each, and stops generating."""
        if self.log is None:
            raise AssertionError("the server's log is needed: start it with the fixture")
        return self.log.read_text(errors="replace").count("Disconnected from client")


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False

"""The real llama.cpp server the tier talks to: one per session.

JETSERVE_LLAMACPP_URL    a server already running (served model JETSERVE_LLAMACPP_MODEL,
                         default `tiny`; started with --interrupt_requests false).
JETSERVE_LLAMACPP_PEERS  the dir `bench/peers/llamacpp.sh install` fills (venv + tiny
                         GGUF): the fixture starts `bench/peers/llamacpp.sh serve PORT`,
                         waits for /v1/models and stops the process group at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jetserve.services import free_port
from tests.llamacpp.llamacppkit import (
    CONTEXT,
    SERVE,
    STARTUP_S,
    LlamaCppServer,
    ready,
)
from tests.vllm.vllmkit import peer_process, tree_rss_mb


@pytest.fixture(scope="session")
def llamacpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppServer]:
    model = os.environ.get("JETSERVE_LLAMACPP_MODEL", "tiny")
    url = os.environ.get("JETSERVE_LLAMACPP_URL")
    if url:
        url = url.rstrip("/").removesuffix("/v1")
        if not ready(url):
            pytest.fail(f"JETSERVE_LLAMACPP_URL={url}: GET /v1/models does not answer 200")
        yield LlamaCppServer(url, model)
        return
    peers = os.environ.get("JETSERVE_LLAMACPP_PEERS")
    if not peers:
        pytest.fail(
            "the llamacpp tier needs JETSERVE_LLAMACPP_URL (a running server) or "
            "JETSERVE_LLAMACPP_PEERS (built by bench/peers/llamacpp.sh install); "
            "bench/peers/llamacpp.sh does both"
        )
    if not (Path(peers) / "llamacpp" / "bin" / "python").exists():
        pytest.fail(f"JETSERVE_LLAMACPP_PEERS={peers} has no llamacpp venv: run install")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("llamacpp") / "llamacpp.log"
    with peer_process(
        ["bash", str(SERVE), "serve", str(port), "--n_ctx", str(CONTEXT)],
        env={**os.environ, "JETSERVE_LLAMACPP_PEERS": peers},
        log=log,
        ready=lambda: ready(url),
        name="llama.cpp",
        startup_s=STARTUP_S,
        poll_s=0.2,
    ) as (proc, startup):
        server = LlamaCppServer(url, model, startup, tree_rss_mb(proc.pid), log)
        rss = server.rss_mb
        print(f"\nllamacpp tier: llama.cpp ({model}) up in {startup:.1f}s, RSS {rss:.0f} MB")
        yield server

"""The real vLLM the tier talks to: one per session.

JETSERVE_VLLM_URL       a server already running (served model JETSERVE_VLLM_MODEL, default
                        `tiny`; start it with --enable-prompt-tokens-details).
JETSERVE_VLLM_PEERS     the dir `bench/peers/vllm.sh install` fills (venv + tiny model): the
                        fixture starts `bench/peers/vllm.sh serve PORT`, waits for /health
                        and stops the whole process group at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jetserve.services import free_port
from tests.vllm.vllmkit import SERVE, STARTUP_S, VllmServer, healthy, peer_process, tree_rss_mb


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    model = os.environ.get("JETSERVE_VLLM_MODEL", "tiny")
    url = os.environ.get("JETSERVE_VLLM_URL")
    if url:
        url = url.rstrip("/").removesuffix("/v1")
        if not healthy(url):
            pytest.fail(f"JETSERVE_VLLM_URL={url}: GET /health does not answer 200")
        yield VllmServer(url, model)
        return
    peers = os.environ.get("JETSERVE_VLLM_PEERS")
    if not peers:
        pytest.fail(
            "the vllm tier needs JETSERVE_VLLM_URL (a running server) or JETSERVE_VLLM_PEERS "
            "(built by bench/peers/vllm.sh install); bench/peers/vllm.sh does both"
        )
    if not (Path(peers) / "vllm" / "bin" / "python").exists():
        pytest.fail(f"JETSERVE_VLLM_PEERS={peers} has no vllm venv: bench/peers/vllm.sh install")
    yield from _serve(tmp_path_factory, peers, "serve", model)


def _serve(
    tmp: pytest.TempPathFactory, peers: str, command: str, model: str
) -> Iterator[VllmServer]:
    """``bench/peers/vllm.sh COMMAND PORT`` in its own process group, until healthy;
    stopped, with EngineCore and its workers, at the end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with peer_process(
        ["bash", str(SERVE), command, str(port)],
        env={**os.environ, "JETSERVE_VLLM_PEERS": peers},
        log=tmp.mktemp("vllm") / f"vllm-{command}.log",
        ready=lambda: healthy(url),
        name="vLLM",
        startup_s=STARTUP_S,
    ) as (proc, startup):
        server = VllmServer(url, model, startup, tree_rss_mb(proc.pid))
        print(f"\nvllm tier: vLLM ({model}) up in {startup:.1f}s, RSS {server.rss_mb:.0f} MB")
        yield server


@pytest.fixture(scope="session")
def vllm_embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """all-MiniLM-L6-v2 on vLLM's pooling runner (JETSERVE_VLLM_EMBED_URL: one
    already running, serving `minilm`)."""
    url = os.environ.get("JETSERVE_VLLM_EMBED_URL")
    if url:
        yield VllmServer(url.rstrip("/").removesuffix("/v1"), "minilm")
        return
    peers = os.environ.get("JETSERVE_VLLM_PEERS")
    if not peers:
        pytest.fail("embedding checks need JETSERVE_VLLM_EMBED_URL or JETSERVE_VLLM_PEERS")
    yield from _serve(tmp_path_factory, peers, "serve-embed", "minilm")

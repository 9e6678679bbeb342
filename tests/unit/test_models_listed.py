"""/v1/models lists what the gateway serves: no embedding model unless one is named
(issue 17, item 7: `sim-embed` was listed in front of a real engine that has none)."""

from __future__ import annotations

from jetserve.cli import build_parser
from jetserve.commands.gateway import config


def test_no_embedding_model_unless_named() -> None:
    cfg = config(build_parser().parse_args(["gateway", "--insecure"]))
    assert cfg.embedding_models == ()
    assert cfg.models == ("sim-8b",)
    named = config(
        build_parser().parse_args(["gateway", "--insecure", "--embedding-models", "e5,bge"])
    )
    assert named.embedding_models == ("e5", "bge")

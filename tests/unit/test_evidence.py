"""Evidence records (streams/evidence.py): which re-evaluation triggers fire."""

from __future__ import annotations

from typing import Any

import msgspec

from streams.evidence import decode_evidence, encode_evidence, new_evidence, triggers
from streams.routes import RouteRecord, contract_from_builtins, fingerprints

NOW = 1_000_000.0


def record(revision: int = 1, **dep_b: Any) -> RouteRecord:
    c = contract_from_builtins(
        {
            "name": "r",
            "candidates": [
                {"name": "a", "adapter": "openai", "engine": "vllm-0.11", "model": "m"},
                {"name": "b", "adapter": "openai", "engine": "vllm-0.11", "model": "m", **dep_b},
            ],
        }
    )
    return RouteRecord(
        contract=c, revision=revision, updated_at=NOW, updated_by="t", fingerprints=fingerprints(c)
    )


def kinds(fired: list[Any]) -> list[tuple[str, str]]:
    return [(t.kind, t.detail.split(":")[0]) for t in fired]


def test_nothing_fires_while_the_revision_is_unchanged() -> None:
    ev = new_evidence(record(), "p1", NOW)
    assert triggers(ev, record(), "p1", NOW + 3600) == []
    assert decode_evidence(encode_evidence(ev)) == ev


def test_a_fingerprint_change_fires_for_the_changed_deployment_only() -> None:
    ev = new_evidence(record(), "p1", NOW)
    fired = triggers(ev, record(2, precision="fp8"), "p1", NOW)
    assert kinds(fired) == [("fingerprint_changed", "b")]


def test_engine_adapter_price_and_expiry() -> None:
    ev = new_evidence(record(), "p1", NOW)
    fired = triggers(ev, record(2, engine="vllm-0.12", adapter="tgi"), "p2", NOW)
    assert kinds(fired) == [
        ("fingerprint_changed", "b"),
        ("adapter_changed", "b"),
        ("engine_changed", "b"),
        ("price_changed", "p1 -> p2"),
    ]
    short = msgspec.structs.replace(ev, max_age_days=1.0)
    assert triggers(short, record(), "p1", NOW + 86_399) == []
    assert kinds(triggers(short, record(), "p1", NOW + 86_400)) == [
        ("expired", "older than 1 days")
    ]


def test_a_deployment_added_or_removed_fires() -> None:
    ev = new_evidence(record(), "p1", NOW)
    c = contract_from_builtins(
        {
            "name": "r",
            "candidates": [{"name": "a", "adapter": "openai", "engine": "vllm-0.11", "model": "m"}],
        }
    )
    fewer = RouteRecord(
        contract=c, revision=2, updated_at=NOW, updated_by="t", fingerprints=fingerprints(c)
    )
    assert kinds(triggers(ev, fewer, "p1", NOW)) == [("fingerprint_changed", "b")]


def test_an_engine_build_change_reported_by_the_workers_fires() -> None:
    ev = new_evidence(record(), "p1", NOW, versions={"a": ("vllm 0.11.0",)})
    same = triggers(ev, record(), "p1", NOW, {"a": ("vllm 0.11.0",), "b": ("vllm 0.12.0",)})
    assert same == []  # b was not evidenced with a version: nothing to compare
    assert triggers(ev, record(), "p1", NOW, {}) == []  # no live worker says: not compared
    rolling = triggers(ev, record(), "p1", NOW, {"a": ("vllm 0.11.0", "vllm 0.12.0")})
    assert [(t.kind, t.detail) for t in rolling] == [
        ("engine_version_changed", "a: vllm 0.11.0 -> vllm 0.11.0, vllm 0.12.0")
    ]
    # Older records (no versions kept) decode and never fire it.
    old = msgspec.json.decode(
        msgspec.json.encode({k: v for k, v in msgspec.to_builtins(ev).items()
                             if k != "engine_versions"}),
        type=type(ev),
    )  # fmt: skip
    assert triggers(old, record(), "p1", NOW, {"a": ("vllm 0.12.0",)}) == []

"""Route contracts: validation at decode, fingerprints, the field diff, the CLI's diff."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from jetserve.commands.routes import format_diff, load_contract
from streams.routes import (
    CoalescePolicy,
    Deployment,
    FallbackPolicy,
    HedgePolicy,
    RetryPolicy,
    RouteContract,
    RouteRecord,
    RoutingPolicy,
    TelemetryPolicy,
    contract_from_builtins,
    decode_contract,
    decode_record,
    diff_contracts,
    encode,
    fingerprint,
    fingerprints,
)

ROOT = Path(__file__).resolve().parents[2]
DEP = Deployment(name="d1", adapter="openai", engine="jetserve-sim", model="sim-8b")
BASE = RouteContract(name="sim-8b", candidates=(DEP,))


def raw(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "sim-8b",
        "candidates": [{"name": "d1", "adapter": "openai", "engine": "e", "model": "m"}],
    }
    body.update(over)
    return body


def test_defaults_match_the_documented_contract() -> None:
    c = decode_contract(json.dumps(raw()).encode())
    assert c.deadline_s == 60.0
    assert c.retry.max_attempts == 3
    assert c.retry.on == ("engine_unavailable", "engine_rate_limited")
    assert c.fallback.enabled
    assert not c.hedge.enabled
    assert c.hedge.delay == "p95"
    assert c.routing.mode == "affinity"
    assert not c.coalesce.enabled
    assert c.telemetry == TelemetryPolicy(record_content=False, sample_rate=1.0)
    dep = c.candidates[0]
    assert (dep.template, dep.precision, dep.kv_policy, dep.batching, dep.hardware) == (
        "default",
        "bf16",
        "prefix-cache",
        "continuous",
        "unspecified",
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (raw(candidates=[]), "length >= 1"),
        (raw(extra=1), "unknown field `extra`"),
        (raw(deadline_s=0), "$.deadline_s"),
        (raw(deadline_s="5"), "$.deadline_s"),
        (raw(retry={"max_attempts": 0}), "$.retry.max_attempts"),
        (raw(retry={"on": ["invalid_request"]}), "not retryable"),
        (raw(hedge={"delay": "p99"}), "$.hedge.delay"),
        (raw(hedge={"delay": -1.0}), "$.hedge.delay"),
        (raw(hedge={"max_extra_ratio": 1.5}), "$.hedge.max_extra_ratio"),
        (raw(telemetry={"sample_rate": -0.1}), "$.telemetry.sample_rate"),
        (raw(routing={"mode": "random"}), "$.routing.mode"),
        (raw(routing={"prefix_chars": 100, "min_prefix_chars": 200}), "min_prefix_chars"),
        (raw(name="has space"), "$.name"),
        # Not KV keys (taken, then every write failed: 503 "unavailable"), or paths
        # below another route's in the admin API.
        (raw(name="a..b"), "single '.' or '/'"),
        (raw(name="a."), "single '.' or '/'"),
        (raw(name=".a"), "single '.' or '/'"),
        (raw(name="org//m"), "single '.' or '/'"),
        (raw(name="x/evidence"), "may not end in '/evidence'"),
        (raw(name="x/status"), "may not end in '/status'"),
        (raw(adapters=["a", "a"]), "appears twice"),
        (raw(adapters=["sim-8b"]), "the route's own name"),
        (raw(adapters=["has space"]), "$.adapters"),
        # One candidate, 16 adapters: 17 pools of ~132 work-queue consumers each.
        (raw(adapters=[f"lora-{n}" for n in range(16)]), "deployment pools"),
        (
            raw(candidates=[{"name": "d", "adapter": "vllm", "engine": "e", "model": "m"}]),
            "adapter",
        ),
        (raw(candidates=[{"name": "d", "adapter": "openai", "engine": "e"}]), "`model`"),
        (
            raw(
                candidates=[
                    {"name": "d", "adapter": "openai", "engine": "e", "model": "m"},
                    {"name": "d", "adapter": "tgi", "engine": "e", "model": "m"},
                ]
            ),
            "appears twice",
        ),
        (
            raw(
                candidates=[{"name": "d", "adapter": "openai", "engine": "e", "model": "m", "x": 1}]
            ),
            "unknown field `x`",
        ),
    ],
)
def test_invalid_contracts_are_refused_with_the_field(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(msgspec.ValidationError) as err:
        decode_contract(json.dumps(body).encode())
    assert needle in str(err.value)
    with pytest.raises(msgspec.ValidationError):
        contract_from_builtins(body)


def test_hedge_delay_is_p95_or_seconds() -> None:
    assert decode_contract(json.dumps(raw(hedge={"delay": 0.25})).encode()).hedge.delay == 0.25
    assert decode_contract(json.dumps(raw(hedge={"delay": "p95"})).encode()).hedge.delay == "p95"


# Every term the fingerprint covers, each changed once.
DEPLOYMENT_CHANGES: list[dict[str, Any]] = [
    {"adapter": "tgi"},
    {"engine": "vllm-0.11.0"},
    {"model": "other"},
    {"template": "chatml"},
    {"precision": "fp8"},
    {"kv_policy": "no-cache"},
    {"batching": "static"},
    {"hardware": "h100"},
    {"context_length": 4096},
]
POLICY_CHANGES: list[dict[str, Any]] = [
    {"deadline_s": 30.0},
    {"retry": RetryPolicy(max_attempts=1)},
    {"retry": RetryPolicy(on=("engine_unavailable",))},
    {"fallback": FallbackPolicy(enabled=False)},
    {"hedge": HedgePolicy(enabled=True)},
    {"hedge": HedgePolicy(delay=0.5)},
    {"hedge": HedgePolicy(min_samples=5)},
    {"hedge": HedgePolicy(max_extra_ratio=0.2)},
    {"routing": RoutingPolicy(mode="round_robin")},
    {"routing": RoutingPolicy(prefix_chars=4096)},
    {"routing": RoutingPolicy(min_prefix_chars=128)},
    {"coalesce": CoalescePolicy(enabled=True)},
    {"coalesce": CoalescePolicy(cross_tenant=True)},
    {"adapters": ("sql-lora",)},
]


def test_fingerprint_is_stable_for_equal_contracts() -> None:
    fp = fingerprint(DEP, BASE)
    assert len(fp) == 16
    assert set(fp) <= set("0123456789abcdef"), fp  # 16 lowercase hex digits
    same = decode_contract(encode(BASE))
    assert fingerprint(same.candidates[0], same) == fp
    # Terms that don't change behaviour don't change it either.
    quiet = msgspec.structs.replace(
        BASE, description="x", telemetry=TelemetryPolicy(sample_rate=0.5)
    )
    assert fingerprint(DEP, quiet) == fp


@pytest.mark.parametrize("change", DEPLOYMENT_CHANGES, ids=lambda c: next(iter(c)))
def test_every_deployment_term_changes_the_fingerprint(change: dict[str, Any]) -> None:
    dep = msgspec.structs.replace(DEP, **change)
    assert fingerprint(dep, BASE) != fingerprint(DEP, BASE)


@pytest.mark.parametrize("change", POLICY_CHANGES, ids=lambda c: repr(c))
def test_every_policy_term_changes_the_fingerprint(change: dict[str, Any]) -> None:
    changed = msgspec.structs.replace(BASE, **change)
    assert fingerprint(DEP, changed) != fingerprint(DEP, BASE)


def test_a_contract_without_context_length_keeps_its_fingerprint() -> None:
    # The field came later: leaving it out hashes exactly what was hashed before.
    terms = {
        "deployment": {k: v for k, v in msgspec.to_builtins(DEP).items() if k != "context_length"},
        "policy": {
            k: msgspec.to_builtins(getattr(BASE, k))
            for k in ("deadline_s", "retry", "fallback", "hedge", "routing", "coalesce")
        },
    }
    old = hashlib.sha256(msgspec.json.encode(terms, order="sorted")).hexdigest()[:16]
    assert fingerprint(DEP, BASE) == old


def test_fingerprints_per_candidate_and_record_round_trip() -> None:
    other = msgspec.structs.replace(DEP, name="d2", hardware="a100")
    c = msgspec.structs.replace(BASE, candidates=(DEP, other))
    fps = fingerprints(c)
    assert set(fps) == {"d1", "d2"}
    assert fps["d1"] != fps["d2"]
    rec = RouteRecord(contract=c, revision=3, updated_at=1.0, updated_by="me", fingerprints=fps)
    assert decode_record(encode(rec)) == rec
    assert c.deployment("d2") == other
    assert c.deployment("nope") is None


def test_diff_names_the_changed_leaves() -> None:
    other = msgspec.structs.replace(DEP, name="d2")
    after = msgspec.structs.replace(
        BASE,
        deadline_s=0.5,
        hedge=HedgePolicy(enabled=True),
        candidates=(other, msgspec.structs.replace(DEP, engine="vllm")),
    )
    changes = {c.path: (c.before, c.after) for c in diff_contracts(BASE, after)}
    assert changes == {
        "deadline_s": (60.0, 0.5),
        "hedge.enabled": (False, True),
        "candidates.order": (["d1"], ["d2", "d1"]),
        "candidates[d1].engine": ("jetserve-sim", "vllm"),
        "candidates[d2].adapter": (None, "openai"),
        "candidates[d2].engine": (None, "jetserve-sim"),
        "candidates[d2].model": (None, "sim-8b"),
        "candidates[d2].template": (None, "default"),
        "candidates[d2].precision": (None, "bf16"),
        "candidates[d2].kv_policy": (None, "prefix-cache"),
        "candidates[d2].batching": (None, "continuous"),
        "candidates[d2].hardware": (None, "unspecified"),
    }
    assert diff_contracts(BASE, BASE) == []
    created = diff_contracts(None, BASE)
    assert {c.path for c in created} >= {"deadline_s", "candidates[d1].engine", "name"}
    assert all(c.before is None for c in created)


def test_cli_diff_format() -> None:
    text = format_diff(
        {
            "name": "sim-8b",
            "from": 1,
            "to": 2,
            "changes": [{"path": "deadline_s", "before": 60.0, "after": 0.5}],
        }
    )
    assert text == "--- sim-8b r1\n+++ sim-8b r2\n- deadline_s: 60.0\n+ deadline_s: 0.5\n"


@pytest.mark.parametrize("name", ["sim-8b.json", "sim-8b-fallback.json"])
def test_example_contracts_are_valid(name: str) -> None:
    c = contract_from_builtins(load_contract(str(ROOT / "deploy" / "routes" / name)))
    assert c.name == "sim-8b"
    assert c.candidates[0].name == "sim-8b-h100"


def test_yaml_contract_with_a_bare_on_key(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: m\ncandidates:\n  - {name: d, adapter: openai, engine: e, model: m}\n"
        "retry:\n  on: [engine_unavailable]\n"
    )
    c = contract_from_builtins(load_contract(str(path)))
    assert c.retry.on == ("engine_unavailable",)


def test_a_rule_for_new_contracts_never_refuses_a_stored_one() -> None:
    # Past the pools cap: refused when applied, but a record stored before the cap
    # still decodes (a gateway refusing it would stop serving the route, and the
    # admin API could not read it to replace it).
    big = raw(adapters=[f"lora-{n}" for n in range(16)])
    with pytest.raises(msgspec.ValidationError):
        contract_from_builtins(big)
    stored = msgspec.convert(big, RouteContract)
    assert msgspec.json.decode(msgspec.json.encode(stored), type=RouteContract) == stored


def test_a_contract_without_adapters_keeps_its_encoding_and_fingerprint() -> None:
    """``adapters`` came later: unset, a record encodes and hashes as before (an
    older gateway, which refuses unknown fields, still reads it)."""
    assert b"adapters" not in encode(BASE)
    with_adapters = msgspec.structs.replace(BASE, adapters=("sql-lora",))
    assert decode_contract(encode(with_adapters)).adapters == ("sql-lora",)
    test_a_contract_without_context_length_keeps_its_fingerprint()

"""Rollouts in the route contract (streams/routes.py) and the canary split
(gateway/inference/rollout.py): validation, fingerprints, and the split's share,
determinism and scope."""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
import pytest

from gateway.inference import rollout
from streams.request_ledger import decode_record as decode_ledger
from streams.routes import (
    CanaryPolicy,
    GuardPolicy,
    Rollback,
    RouteRecord,
    contract_from_builtins,
    decode_contract,
    decode_record,
    encode,
    fingerprints,
)


def raw(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "sim-8b",
        "candidates": [
            {"name": "old", "adapter": "openai", "engine": "e", "model": "m"},
            {"name": "new", "adapter": "openai", "engine": "e2", "model": "m"},
        ],
    }
    body.update(over)
    return body


ROLLOUT = {
    "canary": {"candidate": "new", "share": 0.05, "classes": ["interactive"], "tenants": ["acme"]},
    "shadow": {"candidate": "new", "share": 0.2},
    "guard": {"min_samples": 50, "window_s": 60, "max_error_ratio": 2.0, "max_ttft_p95_ratio": 1.5},
}


def test_the_issue_example_parses_and_round_trips() -> None:
    c = contract_from_builtins(raw(rollout=ROLLOUT))
    assert c.rollout is not None
    assert c.rollout.canary is not None
    assert c.rollout.canary == CanaryPolicy(
        candidate="new", share=0.05, classes=("interactive",), tenants=("acme",)
    )
    assert c.rollout.shadow is not None
    assert c.rollout.shadow.share == 0.2
    assert c.rollout.guard == GuardPolicy()  # the example is the default guard
    assert decode_contract(encode(c)) == c


def test_a_canary_alone_is_valid_and_empty_scopes_mean_all() -> None:
    c = contract_from_builtins(raw(rollout={"canary": {"candidate": "new", "share": 0.1}}))
    assert c.rollout is not None
    assert c.rollout.canary is not None
    assert c.rollout.canary.matches("batch", "anyone")
    assert c.rollout.canary.matches("interactive", "acme")
    assert c.rollout.shadow is None


@pytest.mark.parametrize(
    ("rollout_body", "needle"),
    [
        ({"canary": {"candidate": "nope", "share": 0.1}}, "not one of the route's candidates"),
        ({"shadow": {"candidate": "nope", "share": 0.1}}, "rollout.shadow.candidate"),
        ({"canary": {"candidate": "new", "share": 1.5}}, "<= 1.0"),
        ({"canary": {"candidate": "new", "share": -0.1}}, ">= 0.0"),
        ({"shadow": {"candidate": "new", "share": 2}}, "<= 1.0"),
        ({"canary": {"candidate": "new", "share": 0.1, "classes": ["gold"]}}, "unknown class"),
        ({"canary": {"candidate": "new", "share": 0.1, "tenants": ["a.b"]}}, "tenants"),
        ({"canary": {"candidate": "new"}}, "share"),
        ({"canary": {"candidate": "new", "share": 0.1, "colour": "red"}}, "colour"),
        ({"guard": {"min_samples": 0}}, "min_samples"),
        ({"guard": {"window_s": 0}}, "window_s"),
        ({"guard": {"max_error_ratio": 0}}, "max_error_ratio"),
    ],
)
def test_invalid_rollouts_are_refused(rollout_body: dict[str, Any], needle: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=needle):
        decode_contract(json.dumps(raw(rollout=rollout_body)).encode())


def test_a_canary_needs_another_candidate_for_the_stable_arm() -> None:
    body = raw(rollout={"canary": {"candidate": "old", "share": 0.1}})
    body["candidates"] = body["candidates"][:1]
    with pytest.raises(msgspec.ValidationError, match="another candidate"):
        contract_from_builtins(body)


def test_the_rollout_is_fingerprinted_and_its_absence_keeps_old_fingerprints() -> None:
    plain = contract_from_builtins(raw())
    # What the fingerprints of this contract were before rollouts existed.
    assert fingerprints(plain) == fingerprints(contract_from_builtins(raw(rollout=None)))
    five = fingerprints(contract_from_builtins(raw(rollout=ROLLOUT)))
    ten_rollout = json.loads(json.dumps(ROLLOUT))
    ten_rollout["canary"]["share"] = 0.1
    ten = fingerprints(contract_from_builtins(raw(rollout=ten_rollout)))
    assert len({json.dumps(x, sort_keys=True) for x in (fingerprints(plain), five, ten)}) == 3
    for name in ("old", "new"):
        assert fingerprints(plain)[name] != five[name] != ten[name]


def test_a_record_with_a_rollback_round_trips_and_old_records_decode() -> None:
    c = contract_from_builtins(raw(rollout=ROLLOUT))
    note = Rollback(to_revision=1, from_revision=2, reason="bad canary", automatic=True)
    rec = RouteRecord(
        contract=c,
        revision=3,
        updated_at=1.0,
        updated_by="guard",
        fingerprints=fingerprints(c),
        rollback=note,
    )
    assert decode_record(encode(rec)) == rec
    old = msgspec.json.decode(encode(rec))
    del old["rollback"]
    assert decode_record(msgspec.json.encode(old)).rollback is None


def test_a_ledger_record_without_an_arm_still_decodes() -> None:
    record = {
        "type": "ledger",
        "request_id": "r1",
        "tenant": "t",
        "org": "t",
        "key_id": "k",
        "op": "chat",
        "cls": "interactive",
        "model": "m",
        "attempts": 1,
        "policy": "admitted",
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        "price_version": "v1",
        "charge_micros": 0,
        "reserved_micros": 0,
        "outcome": "stop",
        "status": 200,
        "created": 1.0,
        "duration_ms": 1.0,
        "gateway": "g",
    }
    assert decode_ledger(json.dumps(record).encode()).rollout_arm == ""


# -- the split -----------------------------------------------------------------
CANARY = CanaryPolicy(candidate="new", share=0.1, classes=("interactive",), tenants=("acme",))
KEY = rollout.arms_key(b"s" * 32)


def test_the_split_is_keyed_so_a_client_cannot_pick_its_arm() -> None:
    # An Idempotency-Key names its request id: with a plain hash a tenant could
    # find keys offline that land on the arm it wants. Keyed with the gateways'
    # secret, the arms of the same ids differ from one secret to another.
    ids = [f"{n:032x}" for n in range(400)]
    other = rollout.arms_key(b"t" * 32)
    mine = [rollout.arm(CANARY, "sim-8b", i, "interactive", "acme", KEY) for i in ids]
    theirs = [rollout.arm(CANARY, "sim-8b", i, "interactive", "acme", other) for i in ids]
    assert mine != theirs
    assert 0.05 <= theirs.count("canary") / len(ids) <= 0.15


def test_a_ten_percent_canary_gets_ten_percent_of_its_scope_and_none_outside() -> None:
    ids = [uuid.uuid4().hex for _ in range(2000)]
    arms = [rollout.arm(CANARY, "sim-8b", i, "interactive", "acme", KEY) for i in ids]
    share = arms.count("canary") / len(arms)
    assert 0.07 <= share <= 0.13, share
    assert arms.count("canary") + arms.count("stable") == len(arms)
    # Outside the scope: no arm at all (and the candidates omit the canary).
    assert {rollout.arm(CANARY, "sim-8b", i, "batch", "acme", KEY) for i in ids} == {""}
    assert {rollout.arm(CANARY, "sim-8b", i, "interactive", "other", KEY) for i in ids} == {""}


@pytest.mark.parametrize("seed", range(5))
def test_four_hundred_ids_land_within_three_points(seed: int) -> None:
    ids = [uuid.UUID(int=(seed << 64) + n).hex for n in range(400)]
    # Request ids are random: these are fixed ones, so the check cannot flake.
    arms = [rollout.arm(CANARY, "sim-8b", i, "interactive", "acme", KEY) for i in ids]
    share = arms.count("canary")
    assert 0.07 <= share / 400 <= 0.13, share


def test_the_split_is_deterministic_and_raising_the_share_only_adds_to_the_canary() -> None:
    ids = [uuid.uuid4().hex for _ in range(500)]
    first = [rollout.arm(CANARY, "sim-8b", i, "interactive", "acme", KEY) for i in ids]
    again = [rollout.arm(CANARY, "sim-8b", i, "interactive", "acme", KEY) for i in ids]
    assert first == again
    wider = msgspec.structs.replace(CANARY, share=0.3)
    for i, before in zip(ids, first, strict=True):
        if before == "canary":
            assert rollout.arm(wider, "sim-8b", i, "interactive", "acme", KEY) == "canary"
    none = msgspec.structs.replace(CANARY, share=0.0)
    assert {rollout.arm(none, "sim-8b", i, "interactive", "acme", KEY) for i in ids} == {"stable"}


def test_arms_name_their_candidates() -> None:
    body = raw(rollout={"canary": {"candidate": "old", "share": 0.1}})
    body["candidates"].append({"name": "third", "adapter": "openai", "engine": "e", "model": "m"})
    c = contract_from_builtins(body)
    assert rollout.candidates(c, "canary") == ["old"]
    assert rollout.candidates(c, "stable") == ["new", "third"]
    assert rollout.candidates(c, "") == ["new", "third"]
    no_fallback = contract_from_builtins({**body, "fallback": {"enabled": False}})
    assert rollout.candidates(no_fallback, "stable") == ["new"]
    assert rollout.candidates(no_fallback, "canary") == ["old"]
    plain = contract_from_builtins(raw())
    assert rollout.candidates(plain, "") == ["old", "new"]


def test_records_without_a_rollout_stay_readable_by_older_gateways() -> None:
    """An older gateway's RouteContract refuses unknown fields: unset new ones are left out."""
    c = contract_from_builtins(raw())
    rec = RouteRecord(contract=c, revision=1, updated_at=1.0, updated_by="t", fingerprints={})
    stored = msgspec.json.decode(encode(rec))
    assert "rollout" not in stored["contract"]
    assert "rollback" not in stored
    assert decode_record(encode(rec)) == rec
    with_rollout = contract_from_builtins(raw(rollout=ROLLOUT))
    assert msgspec.json.decode(encode(with_rollout))["rollout"]["canary"]["candidate"] == "new"

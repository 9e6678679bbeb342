"""Rollouts through real NATS, Redis, simulators, a gateway and workers of
three deployments (docs/rollout.md): the canary split by class and tenant, the
ledger's arms, manual rollback to an earlier revision, and the status."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import nats.js.errors
import pytest

from gateway.inference import rollout, shadow
from jetserve.commands.admin_client import AdminError
from jetserve.fleet import Fleet, FleetSpec
from streams.auth import Role
from streams.definitions import DEFAULT_TOPOLOGY
from streams.pools import pool_consumer_name, pool_token
from streams.routes import contract_from_builtins
from streams.subjects import ROLLOUT_EVENTS
from streams.wire import InferenceRequest
from tests.refusals import checked_fleet
from tests.routes_cli import cli, jetserve_cli
from tests.scrape import fleet_sum, metric_sum
from tests.waits import until


def arms_key(fleet: Fleet) -> bytes:
    """The key the fleet's gateways split a route's requests with (its key secret's)."""
    return rollout.arms_key(fleet.key_secret.encode())


pytestmark = [pytest.mark.connected, pytest.mark.timeout(240)]

ROUTES = (
    "r-split", "r-back", "r-bad", "r-status", "r-guard", "r-shadow", "r-shadow-budget",
    "r-evid", "r-slo", "r-slow", "r-ver", "r-shadow-rpm", "r-conf",
)  # fmt: skip
HI = {"role": "user", "content": "hi"}
OTHER = "rollout-other"  # a second tenant, outside the canary's scope


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    aliases = [arg for name in ROUTES for arg in ("--alias", name)]
    # Two gateways: one of them (the lease holder) runs the rollout guard.
    spec = FleetSpec(
        workers=0,
        gateways=2,
        profile="fast",
        engine_per_worker=True,
        sim_args=aliases,
        gateway_args=["--rollout-guard-every", "0.5", "--evidence-watch-every", "0.5"],
    )
    with checked_fleet(request, spec) as f:
        f.start_worker("--deployment-name", "dep-stable")
        f.start_worker("--deployment-name", "dep-canary")
        # Every answer of this engine is a 503: a canary that must be rolled back.
        f.start_worker("--deployment-name", "dep-faulty", sim_args=["--fault-rate", "503=1.0"])
        asyncio.run(pools_attached(f, DEPLOYMENTS))
        yield f


DEPLOYMENTS = ("dep-stable", "dep-canary", "dep-faulty")


async def pools_attached(fleet: Fleet, deps: tuple[str, ...]) -> None:
    """Until each deployment's worker pulls its pool's interactive and batch
    subjects. A request queued in a pool before its worker attaches shows the
    gateway's queue watch a queue that does not drain, and its shedding then
    refuses the next burst (deadline_unmeetable) until the queue empties."""
    async with httpx.AsyncClient(
        base_url=fleet.admin_url, headers={"Authorization": f"Bearer {fleet.admin_token}"}
    ) as c:
        # A route naming them all: the gateways make their pools.
        r = await c.put("/admin/routes/r-warm", json=contract("r-warm", *deps))
        assert r.status_code in (200, 201), r.text
    nc = await fleet.connect(Role.ADMIN, name="rollout-pools")
    js = nc.jetstream()
    names = [
        pool_consumer_name(pool_token(d), cls) for d in deps for cls in ("interactive", "batch")
    ]

    async def pulled() -> bool:
        for name in names:
            try:
                info = await js.consumer_info(DEFAULT_TOPOLOGY.stream, name)
            except nats.js.errors.NotFoundError:
                return False
            if not info.num_waiting:
                return False
        return True

    try:
        await until(pulled, f"workers pulling the pools of {deps}")
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def other_key(fleet: Fleet) -> str:
    with fleet.admin() as admin:
        admin.create_tenant(OTHER)
        return str(admin.create_key(OTHER)["api_key"])


def contract(name: str, *deps: str, **over: Any) -> dict[str, Any]:
    cands = [
        {"name": d, "adapter": "openai", "engine": "jetserve-sim", "model": name} for d in deps
    ]
    return {"name": name, "candidates": cands, **over}


def admin_http(fleet: Fleet) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=fleet.admin_url,
        headers={"Authorization": f"Bearer {fleet.admin_token}"},
        timeout=30,
    )


async def apply(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    async with admin_http(fleet) as c:
        r = await c.put(f"/admin/routes/{body['name']}", json=body)
        assert r.status_code in (200, 201), r.text
        return dict(r.json())


async def chat(
    c: httpx.AsyncClient, fleet: Fleet, model: str, key: str = "", **headers: str
) -> str:
    r = await c.post(
        f"{fleet.base_url}/v1/chat/completions",
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key or fleet.api_key}", **headers},
    )
    assert r.status_code == 200, r.text
    return str(r.headers["x-request-id"])


def ledger(fleet: Fleet, tenant: str, route: str) -> list[dict[str, Any]]:
    with fleet.admin() as admin:
        text = admin.ledger(tenant)
    return [r for r in map(json.loads, text.splitlines()) if r["route"] == route]


async def records_of(fleet: Fleet, tenant: str, route: str, n: int) -> list[dict[str, Any]]:
    """The route's ledger records of ``tenant``, once all ``n`` are in (the
    records go through the outbox, a moment after the answers)."""
    found: list[dict[str, Any]] = []

    async def all_in() -> bool:
        nonlocal found
        found = await asyncio.to_thread(ledger, fleet, tenant, route)
        return len(found) >= n

    await until(all_in, f"{n} ledger records of {tenant} on {route}")
    return found


async def test_a_canary_serves_only_its_share_of_its_scope(fleet: Fleet, other_key: str) -> None:
    tenant = fleet.spec.tenant
    body = contract(
        "r-split",
        "dep-stable",
        "dep-canary",
        rollout={
            "canary": {
                "candidate": "dep-canary",
                "share": 0.3,
                "classes": ["interactive"],
                "tenants": [tenant],
            }
        },
    )
    applied = await apply(fleet, body)
    canary = contract_from_builtins(body).rollout
    assert canary is not None
    assert canary.canary is not None
    async with httpx.AsyncClient(timeout=60) as c:
        ids = await asyncio.gather(
            *(chat(c, fleet, "r-split") for _ in range(40)),
            # A client's idempotency key: the split uses the id the key maps to.
            *(chat(c, fleet, "r-split", **{"Idempotency-Key": f"k-{n}"}) for n in range(8)),
        )
        outside = await asyncio.gather(
            *(chat(c, fleet, "r-split", **{"X-Jetserve-Class": "batch"}) for _ in range(12)),
            *(chat(c, fleet, "r-split", other_key) for _ in range(12)),
        )
    mine = await records_of(fleet, tenant, "r-split", len(ids) + 12)
    theirs = await records_of(fleet, OTHER, "r-split", 12)
    by_id = {r["request_id"]: r for r in mine + theirs}
    assert set(ids) | set(outside) <= set(by_id)
    arms = []
    for request_id in ids:
        r = by_id[request_id]
        assert r["route_revision"] == applied["revision"]
        key = arms_key(fleet)
        want = rollout.arm(canary.canary, "r-split", request_id, "interactive", tenant, key)
        assert r["rollout_arm"] == want, r
        # The canary arm only on the canary deployment; the stable arm never on it.
        assert r["deployment"] == ("dep-canary" if want == "canary" else "dep-stable"), r
        assert r["fingerprint"] == applied["fingerprints"][r["deployment"]]
        arms.append(want)
    assert "canary" in arms
    assert "stable" in arms
    for request_id in outside:
        r = by_id[request_id]
        assert r["rollout_arm"] == "", r
        assert r["deployment"] == "dep-stable", r
    async with httpx.AsyncClient() as c:
        text = (await c.get(fleet.gateway_metrics_urls[0])).text
    for arm in ("stable", "canary"):
        counted = metric_sum(text, "jetserve_rollout_requests_total", route="r-split", arm=arm)
        assert counted == arms.count(arm)


async def test_a_canary_outside_the_candidates_is_a_400(fleet: Fleet) -> None:
    body = contract(
        "r-bad", "dep-stable", rollout={"canary": {"candidate": "dep-canary", "share": 0.1}}
    )
    async with admin_http(fleet) as c:
        r = await c.put("/admin/routes/r-bad", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "not one of the route's candidates" in err["message"]
        assert err["param"] == "rollout.canary.candidate"
        share = contract("r-bad", "dep-stable", "dep-canary")
        share["rollout"] = {"canary": {"candidate": "dep-canary", "share": 1.5}}
        r = await c.put("/admin/routes/r-bad", json=share)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "rollout.canary.share"
        assert (await c.get("/admin/routes/r-bad")).status_code == 404


async def test_a_rollback_restores_an_earlier_revision_with_its_fingerprints(
    fleet: Fleet,
) -> None:
    canary = {"canary": {"candidate": "dep-canary", "share": 1.0}}
    r1 = await apply(fleet, contract("r-back", "dep-stable", "dep-canary"))
    r2 = await apply(fleet, contract("r-back", "dep-stable", "dep-canary", rollout=canary))
    r3 = await apply(
        fleet, contract("r-back", "dep-stable", "dep-canary", rollout=canary, deadline_s=30)
    )
    assert [r["revision"] for r in (r1, r2, r3)] == [1, 2, 3]
    assert len({json.dumps(r["fingerprints"], sort_keys=True) for r in (r1, r2, r3)}) == 3
    async with admin_http(fleet) as c:
        # Refusals first: nothing is written.
        assert (await c.post("/admin/routes/r-back/rollback", json={"to": 9})).status_code == 400
        missing = await c.post("/admin/routes/nope/rollback", json={})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "route_not_found"
        stale = await c.post("/admin/routes/r-back/rollback", json={"expected_revision": 2})
        assert stale.status_code == 409
        assert stale.json()["current_revision"] == 3
        odd = await c.post("/admin/routes/r-back/rollback", json={"to": "1"})
        assert odd.status_code == 400
        async with httpx.AsyncClient(base_url=fleet.admin_url) as anon:
            assert (await anon.post("/admin/routes/r-back/rollback", json={})).status_code == 401
            assert (await anon.get("/admin/routes/r-back/status")).status_code == 401

        back = await c.post(
            "/admin/routes/r-back/rollback",
            json={"to": 1, "reason": "canary too slow"},
            headers={"X-Jetserve-Actor": "ops@test"},
        )
        assert back.status_code == 200, back.text
        r4 = back.json()
        assert r4["changed"] is True
        assert r4["revision"] == 4
        assert r4["fingerprints"] == r1["fingerprints"]
        assert r4["contract"] == r1["contract"]
        assert r4["rollback"] == {
            "to_revision": 1,
            "from_revision": 3,
            "reason": "canary too slow",
            "automatic": False,
        }
        shown = (await c.get("/admin/routes/r-back")).json()
        assert shown["revision"] == 4
        assert shown["fingerprints"] == r1["fingerprints"]
        history = (await c.get("/admin/routes/r-back/history")).json()["data"]
        assert [h["revision"] for h in history] == [1, 2, 3, 4]
        assert history[3]["rollback"]["reason"] == "canary too slow"
        assert history[3]["updated_by"] == "ops@test"
        assert "rollback" not in history[2]
        # Rolling back to the contract in force writes nothing.
        same = await c.post("/admin/routes/r-back/rollback", json={"to": 1})
        assert same.json()["changed"] is False
        assert same.json()["revision"] == 4

    # The data plane serves revision 4 as revision 1 was served: no canary.
    async with httpx.AsyncClient(timeout=60) as c:
        ids = await asyncio.gather(*(chat(c, fleet, "r-back") for _ in range(6)))
    served = {
        r["request_id"]: r for r in await records_of(fleet, fleet.spec.tenant, "r-back", len(ids))
    }
    for request_id in ids:
        r = served[request_id]
        assert r["route_revision"] == 4
        assert r["deployment"] == "dep-stable"
        assert r["rollout_arm"] == ""
        assert r["fingerprint"] == r1["fingerprints"]["dep-stable"]

    # The CLI: by default, the newest earlier revision with another contract (3).
    out = await asyncio.to_thread(cli, fleet, "rollback", "r-back", "--reason", "retry it")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "revision 5: revision 3 restored"
    assert f"dep-canary  {r3['fingerprints']['dep-canary']}" in out.stdout
    history_out = await asyncio.to_thread(cli, fleet, "history", "r-back")
    lines = history_out.stdout.splitlines()
    assert lines[3].endswith("(rollback to r1 from r3: canary too slow)")
    assert lines[4].endswith("(rollback to r3 from r4: retry it)")
    refused = await asyncio.to_thread(cli, fleet, "rollback", "r-back", "--to", "7")
    assert refused.returncode == 1
    assert "400" in refused.stderr


async def test_the_status_counts_the_arms_from_the_ledger(fleet: Fleet) -> None:
    guard = {"min_samples": 3, "window_s": 300, "max_ttft_p95_ratio": 1000}
    body = contract(
        "r-status",
        "dep-stable",
        "dep-canary",
        rollout={"canary": {"candidate": "dep-canary", "share": 0.5}, "guard": guard},
    )
    applied = await apply(fleet, body)
    async with admin_http(fleet) as c:
        before = (await c.get("/admin/routes/r-status/status")).json()
        assert before["arms"]["canary"]["requests"] == 0
        assert before["decision"] == "collecting"
        assert (await c.get("/admin/routes/nope/status")).status_code == 404
    async with httpx.AsyncClient(timeout=60) as c:
        ids = await asyncio.gather(*(chat(c, fleet, "r-status") for _ in range(24)))
    served = await records_of(fleet, fleet.spec.tenant, "r-status", len(ids))
    arms = [r["rollout_arm"] for r in served]
    async with admin_http(fleet) as c:
        st = (await c.get("/admin/routes/r-status/status")).json()
    assert st["revision"] == applied["revision"]
    assert st["arms"]["stable"]["requests"] == arms.count("stable")
    assert st["arms"]["canary"]["requests"] == arms.count("canary")
    assert st["shares"]["canary"] == arms.count("canary") / len(arms)
    assert st["guard"]["canary"]["requests"] == arms.count("canary")
    assert st["guard"]["canary"]["ttft_p95_ms"] > 0
    if min(arms.count("stable"), arms.count("canary")) >= 3:  # P(not) ~ 1e-5
        assert st["decision"] == "healthy", st["reason"]
        assert st["guard"]["error_ratio"] == 1.0
    out = await asyncio.to_thread(cli, fleet, "status", "r-status")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(f"r-status revision {applied['revision']}")
    assert f"decision: {st['decision']}" in out.stdout


async def test_the_guard_rolls_a_failing_canary_back_within_its_window(fleet: Fleet) -> None:
    base = contract("r-guard", "dep-stable", "dep-faulty", retry={"max_attempts": 1})
    r1 = await apply(fleet, base)
    window_s = 120.0
    canary = {"candidate": "dep-faulty", "share": 0.4}
    guarded = {
        **base,
        "rollout": {"canary": canary, "guard": {"min_samples": 5, "window_s": window_s}},
    }
    r2 = await apply(fleet, guarded)
    split = contract_from_builtins(guarded).rollout
    assert split is not None
    assert split.canary is not None
    events: list[dict[str, Any]] = []
    nc = await fleet.connect(Role.ADMIN, name="rollout-events")

    async def on_event(msg: Any) -> None:
        events.append(json.loads(msg.data))

    await nc.subscribe(ROLLOUT_EVENTS, cb=on_event)
    sent: dict[str, int] = {}  # request id -> the status its client saw
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as c, admin_http(fleet) as admin:

        async def one() -> None:
            r = await c.post(
                f"{fleet.base_url}/v1/chat/completions",
                json={
                    "model": "r-guard",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                headers={"Authorization": f"Bearer {fleet.api_key}"},
            )
            sent[r.headers["x-request-id"]] = r.status_code

        async def rolled_back() -> bool:
            """Traffic, a batch at a time, until the guard has written a revision."""
            await asyncio.gather(*(one() for _ in range(8)))
            shown = (await admin.get("/admin/routes/r-guard")).json()
            return bool(shown["revision"] > r2["revision"])

        await until(rolled_back, "the guard's rollback", bound_s=window_s, every_s=0)
        elapsed = time.monotonic() - t0
        r3 = (await admin.get("/admin/routes/r-guard")).json()
        status = (await admin.get("/admin/routes/r-guard/status")).json()
    assert elapsed < window_s
    assert r3["revision"] == r2["revision"] + 1
    assert r3["contract"] == r1["contract"]
    assert r3["fingerprints"] == r1["fingerprints"]
    assert r3["updated_by"] == "rollout-guard"
    back = r3["rollback"]
    assert (back["to_revision"], back["from_revision"], back["automatic"]) == (1, 2, True)
    assert back["reason"].startswith("rollout guard: canary error rate 100.0%"), back
    assert status["decision"] == "no_canary"
    assert status["rollback"] == back

    # One gateway judged and rolled back; the event went out.
    urls = fleet.gateway_metrics_urls
    rollbacks = await fleet_sum(urls, "jetserve_rollout_rollbacks_total", route="r-guard")
    assert rollbacks == 1

    async def one_leader() -> bool:
        # A holder that lost its lease (a late renewal) says so at its next tick.
        return await fleet_sum(urls, "jetserve_rollout_guard_leader") == 1

    await until(one_leader, "one guard leader")
    await until(lambda: _true(bool(events)), "the rollout event")
    await nc.close()
    assert events[0]["route"] == "r-guard"
    assert (events[0]["revision"], events[0]["to_revision"]) == (r3["revision"], 1)

    # Nothing lost: every request has its record, on the arm the split chose,
    # the canary's failed, the stable arm's served.
    records = await records_of(fleet, fleet.spec.tenant, "r-guard", len(sent))
    by_id = {r["request_id"]: r for r in records}
    assert set(sent) <= set(by_id)
    for request_id, code in sent.items():
        r = by_id[request_id]
        assert r["status"] == code
        assert r["route_revision"] in (r2["revision"], r3["revision"])
        if r["route_revision"] == r3["revision"]:
            assert r["rollout_arm"] == ""
            assert code == 200
            continue
        arm = rollout.arm(
            split.canary, "r-guard", request_id, "interactive", fleet.spec.tenant, arms_key(fleet)
        )
        assert r["rollout_arm"] == arm
        if arm == "canary":
            assert code >= 500, r
            assert r["deployment"] in ("", "dep-faulty"), r
        else:
            assert code == 200, r
            assert r["deployment"] == "dep-stable", r
    # After the rollback: the faulty deployment serves nothing.
    async with httpx.AsyncClient(timeout=60) as c:
        after = await asyncio.gather(*(chat(c, fleet, "r-guard") for _ in range(8)))
    more = await records_of(fleet, fleet.spec.tenant, "r-guard", len(sent) + len(after))
    for r in more:
        if r["request_id"] in after:
            assert (r["route_revision"], r["deployment"]) == (r3["revision"], "dep-stable")
    history = await asyncio.to_thread(cli, fleet, "history", "r-guard")
    assert "(automatic rollback to r1 from r2: rollout guard: canary error rate" in history.stdout
    # The judged revision's evidence keeps the guard's final figures (written
    # just after the rollback).
    shown: dict[str, Any] = {}
    async with admin_http(fleet) as admin:

        async def evidenced() -> bool:
            nonlocal shown
            r = await admin.get("/admin/routes/r-guard/evidence", params={"revision": 2})
            shown = r.json()
            return bool(shown["evidence"] and shown["evidence"]["guard"])

        await until(evidenced, "the guard's figures in revision 2's evidence")
    assert shown["evidence"]["revision"] == 2
    assert shown["evidence"]["guard"]["decision"] == "failing"
    assert shown["evidence"]["guard"]["figures"]["canary"]["errors"] >= 5
    assert shown["evidence"]["fingerprints"] == r2["fingerprints"]


async def _true(value: bool) -> bool:
    return value


async def test_shadow_copies_are_run_recorded_never_returned_and_charged_to_the_operator(
    fleet: Fleet,
) -> None:
    client = "shadow-client"
    with fleet.admin() as admin:
        admin.create_tenant(client)
        key = str(admin.create_key(client)["api_key"])
    body = contract(
        "r-shadow",
        "dep-stable",
        "dep-canary",
        rollout={"shadow": {"candidate": "dep-canary", "share": 0.5}},
    )
    applied = await apply(fleet, body)
    contract_ = contract_from_builtins(body)

    async def ask(c: httpx.AsyncClient, **extra: Any) -> str:
        body = {"model": "r-shadow", "max_tokens": 8, "temperature": 0, "messages": [HI]}
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={**body, **extra},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        return str(r.headers["x-request-id"])

    async with httpx.AsyncClient(timeout=60) as c:
        ids = await asyncio.gather(*(ask(c) for _ in range(16)))
        # Streamed too: the copy is the same, the client reads only its own answer.
        ids.append(await ask(c, stream=True))

    def copied(request_id: str) -> bool:
        probe = InferenceRequest(
            id=request_id, op="chat", cls="interactive", model="r-shadow", body={}, reply="",
            deadline=0.0, route="r-shadow",
        )  # fmt: skip
        return shadow.chosen(contract_, probe, arms_key(fleet)) == "dep-canary"

    want = [i for i in ids if copied(i)]
    assert want, "no id of 17 drew a copy at 50%"
    served = await records_of(fleet, client, "r-shadow", len(ids))
    # The client's own records: served by the stable deployment, none a shadow.
    assert {r["deployment"] for r in served} == {"dep-stable"}
    assert not any(r["shadow"] for r in served)
    copies = await records_of(fleet, shadow.SHADOW_TENANT, "r-shadow", len(want))
    assert sorted(r["shadow_of"] for r in copies) == sorted(want)
    for r in copies:
        assert r["shadow"] is True
        assert r["request_id"] == r["shadow_of"] + shadow.SHADOW_SUFFIX
        assert (r["deployment"], r["cls"], r["status"]) == ("dep-canary", "batch", 200)
        assert r["fingerprint"] == applied["fingerprints"]["dep-canary"]
        assert r["charge_micros"] > 0  # the operator tenant's
        assert r["usage"]["completion_tokens"] > 0
    # The tenant paid for its own requests, and for nothing else.
    with fleet.admin() as admin:
        shown = admin.show_tenant(client)
    assert shown["spent_micros"] == sum(r["charge_micros"] for r in served)
    assert shown["reserved_micros"] == 0
    # A client cannot read a shadow's answer: it is another tenant's stream.
    async with httpx.AsyncClient(timeout=30) as c:
        resume = await c.get(
            f"{fleet.base_url}/v1/requests/{want[0]}{shadow.SHADOW_SUFFIX}/stream",
            headers={"Authorization": f"Bearer {key}"},
        )
        assert resume.status_code == 404
        text = (await c.get(fleet.gateway_metrics_urls[0])).text
    ok = metric_sum(text, "jetserve_rollout_shadows_total", route="r-shadow", result="ok")
    assert ok == len(want)
    async with admin_http(fleet) as c:
        st = (await c.get("/admin/routes/r-shadow/status")).json()
    assert st["decision"] == "no_canary"
    summary = st["shadow"]
    assert (summary["copies"], summary["paired"], summary["errors"]) == (len(want), len(want), 0)
    assert summary["error_class_mismatches"] == 0
    assert summary["ttft_ratio_p50"] > 0
    assert summary["output_tokens_ratio_p50"] > 0
    # Both simulators answer a prompt with the same text at temperature 0.
    assert (summary["exact_compared"], summary["exact_matches"]) == (len(want), len(want))
    assert {r["shadow_exact_match"] for r in copies} == {True}
    assert summary["json_checked"] == 0

    # Every request copied, two asking for JSON: the copy's JSON is checked.
    await apply(fleet, {**body, "rollout": {"shadow": {"candidate": "dep-canary", "share": 1.0}}})
    async with httpx.AsyncClient(timeout=60) as c:
        asked = await asyncio.gather(
            *(ask(c, response_format={"type": "json_object"}) for _ in range(2))
        )
    copies = await records_of(fleet, shadow.SHADOW_TENANT, "r-shadow", len(want) + 2)
    checked = {r["shadow_of"]: r["shadow_json_valid"] for r in copies if r["shadow_of"] in asked}
    assert set(checked) == set(asked)
    assert all(isinstance(v, bool) for v in checked.values()), checked
    async with admin_http(fleet) as c:
        st = (await c.get("/admin/routes/r-shadow/status")).json()
    assert st["shadow"]["json_checked"] == 2
    # The served answers of the same requests are checked too, so the rates compare.
    assert st["shadow"]["served_json_checked"] == 2
    served_json = [r["shadow_served_json_valid"] for r in copies if r["shadow_of"] in asked]
    assert all(isinstance(v, bool) for v in served_json), served_json
    assert st["shadow"]["served_json_valid"] == sum(served_json)
    # The operator tenant paid for every copy, exactly what its records say.
    spent, records = await operator_books(fleet)
    assert spent == sum(r["charge_micros"] for r in records) > 0
    assert all(r["shadow"] for r in records)


async def operator_books(fleet: Fleet) -> tuple[int, list[dict[str, Any]]]:
    """The operator tenant's spend (nothing left reserved) and its ledger records."""
    with fleet.admin() as admin:
        limits = admin.get_limits("tenant", shadow.SHADOW_TENANT)
        text = admin.ledger(shadow.SHADOW_TENANT)
    assert limits["reserved_micros"] == 0
    return int(limits["spent_micros"]), [json.loads(line) for line in text.splitlines()]


async def test_an_exhausted_operator_budget_stops_shadows_never_requests(fleet: Fleet) -> None:
    client = "shadow-budget-client"
    with fleet.admin() as admin:
        admin.create_tenant(client)
        key = str(admin.create_key(client)["api_key"])
        with pytest.raises(AdminError) as refused:
            admin.create_tenant(shadow.SHADOW_TENANT)
    assert refused.value.status == 400  # the operator tenant is built in, never a tenant's id
    rollout_ = {"shadow": {"candidate": "dep-canary", "share": 1.0}}
    await apply(fleet, contract("r-shadow-budget", "dep-stable", "dep-canary", rollout=rollout_))
    spent, before = await operator_books(fleet)
    with fleet.admin() as admin:
        # The operator's shadow budget, set like any tenant's: already spent.
        admin.set_limits("tenant", shadow.SHADOW_TENANT, budget_micros=spent)
    urls = fleet.gateway_metrics_urls
    exhausted = await fleet_sum(urls, "jetserve_rollout_shadows_total", result="budget_exhausted")

    async def ask(c: httpx.AsyncClient) -> str:
        return await chat(c, fleet, "r-shadow-budget", key)

    async with httpx.AsyncClient(timeout=60) as c:
        ids = await asyncio.gather(*(ask(c) for _ in range(6)))  # every one answered

    async def all_stopped() -> bool:
        now = await fleet_sum(urls, "jetserve_rollout_shadows_total", result="budget_exhausted")
        return now - exhausted >= len(ids)

    await until(all_stopped, "6 shadows stopped by the operator budget")
    served = await records_of(fleet, client, "r-shadow-budget", len(ids))
    assert sorted(r["request_id"] for r in served) == sorted(ids)
    assert {(r["status"], r["deployment"]) for r in served} == {(200, "dep-stable")}
    # The client paid for its own requests only; the operator paid nothing more.
    with fleet.admin() as admin:
        assert admin.show_tenant(client)["spent_micros"] == sum(r["charge_micros"] for r in served)
    assert await operator_books(fleet) == (spent, before)

    # A budget with room again: the copies run, and are charged to it.
    with fleet.admin() as admin:
        admin.set_limits("tenant", shadow.SHADOW_TENANT, budget_micros=spent + 1_000_000)
    async with httpx.AsyncClient(timeout=60) as c:
        again = await asyncio.gather(*(ask(c) for _ in range(2)))
    copies = await records_of(fleet, shadow.SHADOW_TENANT, "r-shadow-budget", 2)
    assert sorted(r["shadow_of"] for r in copies) == sorted(again)
    now_spent, records = await operator_books(fleet)
    assert now_spent == sum(r["charge_micros"] for r in records) > spent
    with fleet.admin() as admin:
        admin.set_limits("tenant", shadow.SHADOW_TENANT)  # unlimited again


async def test_evidence_is_kept_per_revision_and_its_triggers_fire(fleet: Fleet) -> None:
    r1 = await apply(fleet, contract("r-evid", "dep-stable", "dep-canary"))
    async with admin_http(fleet) as c:
        none = (await c.get("/admin/routes/r-evid/evidence")).json()
        assert none["evidence"] is None
        assert none["due"] is True
        bench = {"ttft_p95_ms": 120.0, "run": "bench/results/fleet/rollout.json"}
        put = await c.put(
            "/admin/routes/r-evid/evidence",
            json={"approved_by": "ops@test", "bench": bench, "conformance": {"dep-canary": {}}},
        )
        assert put.status_code == 200, put.text
        again = await c.put("/admin/routes/r-evid/evidence", json={"approved_by": "lead@test"})
        evidence = again.json()
        assert evidence["approved_by"] == ["ops@test", "lead@test"]
        assert evidence["bench"] == bench
        assert evidence["fingerprints"] == r1["fingerprints"]
        fresh = (await c.get("/admin/routes/r-evid/evidence")).json()
        assert (fresh["due"], fresh["triggers"]) == (False, [])
        # A revision past the route's: 404 at once (it was read down from, one
        # revision at a time, a scan without end for a huge number).
        past = {"revision": 10**12}
        beyond = await c.get("/admin/routes/r-evid/evidence", params=past)
        assert beyond.status_code == 404, beyond.text
        assert beyond.json()["error"]["code"] == "revision_not_found"
        bad = await c.put("/admin/routes/r-evid/evidence", json={"revision": 9})
        assert bad.status_code == 404
        odd = await c.put("/admin/routes/r-evid/evidence", json={"approve": "x"})
        assert odd.status_code == 400

    # A new revision changes one deployment: its fingerprint trigger fires,
    # measured against revision 1's evidence (revision 2 has none yet).
    changed = contract("r-evid", "dep-stable", "dep-canary")
    changed["candidates"][1].update(precision="fp8", engine="jetserve-sim-2")
    events = await rollout_events(fleet)
    r2 = await apply(fleet, changed)
    # The evidence watch sees it without anyone reading the evidence: a gauge per
    # fired kind, a counter, and one event naming both triggers.
    urls = fleet.gateway_metrics_urls

    async def watched() -> bool:
        due = await fleet_sum(urls, "jetserve_route_evidence_due", route="r-evid")
        return due == 2 and any(e["route"] == "r-evid" for e in events.seen)

    await until(watched, "the evidence watch to see r-evid's triggers")
    await events.close()
    (event,) = [e for e in events.seen if e["route"] == "r-evid"]
    assert (event["kind"], event["revision"], event["evidence_revision"]) == ("evidence_due", 2, 1)
    assert sorted(t["kind"] for t in event["triggers"]) == ["engine_changed", "fingerprint_changed"]
    counted = await fleet_sum(urls, "jetserve_route_evidence_triggers_fired_total", route="r-evid")
    assert counted == 2
    async with admin_http(fleet) as c:
        st = (await c.get("/admin/routes/r-evid/evidence")).json()
    assert (st["current_revision"], st["evidence"]["revision"], st["due"]) == (2, 1, True)
    fired = {(t["kind"], t["detail"]) for t in st["triggers"]}
    before, after = r1["fingerprints"]["dep-canary"], r2["fingerprints"]["dep-canary"]
    assert fired == {
        ("fingerprint_changed", f"dep-canary: {before} -> {after}"),
        ("engine_changed", "dep-canary: jetserve-sim -> jetserve-sim-2"),
    }
    out = await asyncio.to_thread(cli, fleet, "evidence", "r-evid")
    assert out.returncode == 0, out.stderr
    assert f"fingerprint_changed: dep-canary: {before} -> {after}" in out.stdout

    # Expiry: evidence older than its max age is due again.
    # Approving revision 2 evidences it: nothing has fired against its own record.
    out = await asyncio.to_thread(cli, fleet, "evidence", "r-evid", "--approve")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("r-evid evidence of revision 2 (current 2)")
    assert out.stdout.rstrip().endswith("no trigger has fired")
    async with admin_http(fleet) as c:
        await c.put("/admin/routes/r-evid/evidence", json={"max_age_days": 1e-5})

        async def expired() -> bool:
            st = (await c.get("/admin/routes/r-evid/evidence")).json()
            return any(t["kind"] == "expired" for t in st["triggers"])

        await until(expired, "the evidence to expire")


async def test_an_slo_regression_after_the_evidence_fires_its_trigger(fleet: Fleet) -> None:
    # A deployment of its own, healthy while its evidence is recorded.
    healthy = await asyncio.to_thread(fleet.start_worker, "--deployment-name", "dep-slo")
    await pools_attached(fleet, ("dep-slo",))
    guard = {"min_samples": 6, "window_s": 300}
    body = contract("r-slo", "dep-slo", retry={"max_attempts": 1}, rollout={"guard": guard})
    await apply(fleet, body)
    tenant = fleet.spec.tenant

    async def ask(c: httpx.AsyncClient) -> int:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={"model": "r-slo", "max_tokens": 4, "messages": [HI]},
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
        return r.status_code

    async with httpx.AsyncClient(timeout=60) as c:
        assert [await ask(c) for _ in range(8)] == [200] * 8
    await records_of(fleet, tenant, "r-slo", 8)
    out = await asyncio.to_thread(cli, fleet, "evidence", "r-slo", "--approve", "--measure-slo")
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("no trigger has fired"), out.stdout
    async with admin_http(fleet) as c:
        shown = (await c.get("/admin/routes/r-slo/evidence")).json()
    slo = shown["evidence"]["slo"]
    assert (slo["requests"], slo["errors"], slo["revision"]) == (8, 0, 1)
    assert slo["ttft_p95_ms"] > 0

    # The same deployment gets worse (its contract and fingerprint unchanged): its
    # worker is replaced by one whose engine answers every request with a 503.
    await asyncio.to_thread(healthy.stop)
    await asyncio.to_thread(
        fleet.start_worker, "--deployment-name", "dep-slo", sim_args=["--fault-rate", "503=1.0"]
    )
    async with httpx.AsyncClient(timeout=60) as c:
        statuses = [await ask(c) for _ in range(8)]
    assert statuses.count(503) >= 6, statuses
    await records_of(fleet, tenant, "r-slo", 16)

    async def fired() -> bool:
        out = await asyncio.to_thread(cli, fleet, "evidence", "r-slo")
        return "slo_regression: error rate" in out.stdout

    await until(fired, "the slo_regression trigger to fire")

    async def watched() -> bool:
        due = await fleet_sum(
            fleet.gateway_metrics_urls, "jetserve_route_evidence_due", route="r-slo",
            kind="slo_regression",
        )  # fmt: skip
        return due == 1

    # The evidence watch compares the same figures from its in-memory window.
    await until(watched, "the evidence watch to see r-slo's regression")
    async with admin_http(fleet) as c:
        st = (await c.get("/admin/routes/r-slo/evidence")).json()
    assert st["due"] is True
    (trigger,) = st["triggers"]
    assert trigger["kind"] == "slo_regression"
    assert "vs measured r1 0.0% (0/8)" in trigger["detail"], trigger
    assert trigger["detail"].endswith("> 2")


class Events:
    """What ``jetserve.rollout.events`` carries while subscribed."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.seen: list[dict[str, Any]] = []

    async def on(self, msg: Any) -> None:
        self.seen.append(json.loads(msg.data))

    async def close(self) -> None:
        await self.nc.close()


async def rollout_events(fleet: Fleet) -> Events:
    nc = await fleet.connect(Role.ADMIN, name="rollout-events")
    events = Events(nc)
    await nc.subscribe(ROLLOUT_EVENTS, cb=events.on)
    await nc.flush()
    return events


async def test_the_guard_rolls_a_slow_canary_back_on_its_first_token_p95(fleet: Fleet) -> None:
    # Every first token of this deployment's engine comes 250 ms late; the
    # stable deployment's within milliseconds. Nothing fails: only the
    # first-token guard can see it.
    await asyncio.to_thread(
        fleet.start_worker,
        "--deployment-name",
        "dep-slow",
        sim_args=["--fault-rate", "stall:250=1.0"],
    )
    await pools_attached(fleet, ("dep-slow",))
    await apply(fleet, contract("r-slow", "dep-stable", "dep-slow"))
    guard = {"min_samples": 5, "window_s": 120, "max_ttft_p95_ratio": 1.5}
    canary = {"candidate": "dep-slow", "share": 0.5}
    await apply(fleet, contract("r-slow", "dep-stable", "dep-slow",
                                rollout={"canary": canary, "guard": guard}))  # fmt: skip
    sent: list[str] = []
    async with admin_http(fleet) as admin, httpx.AsyncClient(timeout=60) as c:

        async def rolled_back() -> bool:
            sent.extend(await asyncio.gather(*(chat(c, fleet, "r-slow") for _ in range(8))))
            shown = (await admin.get("/admin/routes/r-slow")).json()
            return bool(shown["revision"] == 3)

        await until(rolled_back, "the guard's rollback of the slow canary", every_s=0)
        r3 = (await admin.get("/admin/routes/r-slow")).json()
    back = r3["rollback"]
    assert (back["to_revision"], back["from_revision"], back["automatic"]) == (1, 2, True)
    assert back["reason"].startswith("rollout guard: canary first-token p95"), back
    records = await records_of(fleet, fleet.spec.tenant, "r-slow", len(sent))
    mine = [r for r in records if r["request_id"] in set(sent)]
    # Slow, never failed: every request of both arms was served.
    assert {r["status"] for r in mine} == {200}
    slow = [r["first_token_ms"] for r in mine if r["rollout_arm"] == "canary"]
    fast = [r["first_token_ms"] for r in mine if r["rollout_arm"] == "stable"]
    assert min(len(slow), len(fast)) >= 5
    assert min(slow) > 1.5 * max(fast)


async def test_a_new_engine_build_under_a_deployment_fires_its_trigger(fleet: Fleet) -> None:
    # The contract names the deployment, not its build: a new engine version
    # behind the same deployment changes no fingerprint. The workers say it.
    old = await asyncio.to_thread(
        fleet.start_worker, "--deployment-name", "dep-ver", sim_args=["--engine-version", "1.0"]
    )
    await pools_attached(fleet, ("dep-ver",))
    await apply(fleet, contract("r-ver", "dep-ver"))
    async with admin_http(fleet) as c:
        approved: dict[str, Any] = {}

        async def evidenced() -> bool:
            nonlocal approved
            put = await c.put("/admin/routes/r-ver/evidence", json={"approved_by": "ops@test"})
            approved = put.json()
            return bool(approved["engine_versions"])

        await until(evidenced, "an approval that keeps dep-ver's engine build")
        assert approved["engine_versions"] == {"dep-ver": ["vllm 1.0"]}
        assert (await c.get("/admin/routes/r-ver/evidence")).json()["triggers"] == []

        await asyncio.to_thread(old.stop)
        await asyncio.to_thread(
            fleet.start_worker, "--deployment-name", "dep-ver", sim_args=["--engine-version", "2.0"]
        )
        want = {"kind": "engine_version_changed", "detail": "dep-ver: vllm 1.0 -> vllm 2.0"}

        async def fired() -> bool:
            shown = (await c.get("/admin/routes/r-ver/evidence")).json()
            return bool(shown["triggers"] == [want])

        await until(fired, "the engine_version_changed trigger")

    async def watched() -> bool:
        due = await fleet_sum(
            fleet.gateway_metrics_urls, "jetserve_route_evidence_due", route="r-ver",
            kind="engine_version_changed",
        )  # fmt: skip
        return due == 1

    await until(watched, "the evidence watch to see the new build")


async def test_shadow_copies_never_count_in_the_tenants_rate_limits(fleet: Fleet) -> None:
    client = "shadow-rpm-client"
    with fleet.admin() as admin:
        admin.create_tenant(client)
        key = str(admin.create_key(client)["api_key"])
        # A burst of 6 requests (a tenth of the minute's 60), then one a second.
        admin.set_limits("tenant", client, rpm=60)
    rollout_ = {"shadow": {"candidate": "dep-canary", "share": 1.0}}
    await apply(fleet, contract("r-shadow-rpm", "dep-stable", "dep-canary", rollout=rollout_))
    async with httpx.AsyncClient(timeout=60) as c:
        # Every request is copied, each copy sent before the next request. Were
        # the copies counted, the fourth request would find the burst spent.
        ids = [await chat(c, fleet, "r-shadow-rpm", key) for _ in range(6)]
    copies = await records_of(fleet, shadow.SHADOW_TENANT, "r-shadow-rpm", len(ids))
    assert sorted(r["shadow_of"] for r in copies) == sorted(ids)
    assert {r["status"] for r in copies} == {200}


async def test_gathered_evidence_is_checked_against_the_fingerprints_it_covers(
    fleet: Fleet,
) -> None:
    r1 = await apply(fleet, contract("r-conf", "dep-stable", "dep-canary"))
    fp = r1["fingerprints"]["dep-canary"]
    canary_engine = f"http://127.0.0.1:{fleet.worker_sim_ports[DEPLOYMENTS.index('dep-canary')]}"
    # The corpus against the engine dep-canary's workers use, attached as its
    # conformance evidence with the fingerprint read before the run.
    out = await asyncio.to_thread(
        jetserve_cli, fleet, "conformance", "--engine", canary_engine, "--dialect", "openai",
        "--model", "r-conf", "--evidence", "r-conf", "--deployment", "dep-canary",
        timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    assert f"attached to r-conf r1 as dep-canary's conformance (fingerprint {fp})" in out.stdout
    async with admin_http(fleet) as c:
        ev = (await c.get("/admin/routes/r-conf/evidence")).json()["evidence"]
        assert ev["conformance"]["dep-canary"]["ok"] is True
        assert len(ev["conformance"]["dep-canary"]["rows"]) >= 40
        assert ev["checked"] == {"conformance/dep-canary": {"dep-canary": fp}}
        # Results measured on another fingerprint are refused, not stored.
        stale = await c.put(
            "/admin/routes/r-conf/evidence",
            json={"bench": {"p95": 1}, "covers": {"dep-canary": "0" * len(fp)}},
        )
        assert stale.status_code == 409, stale.text
        assert stale.json()["error"]["code"] == "evidence_fingerprint_mismatch"
        unknown = await c.put(
            "/admin/routes/r-conf/evidence", json={"bench": {}, "covers": {"dep-x": fp}}
        )
        assert unknown.status_code == 400, unknown.text
        bare = await c.put("/admin/routes/r-conf/evidence", json={"covers": {"dep-canary": fp}})
        assert bare.status_code == 400, bare.text
        # A result attached without covers is kept as given, and says so.
        given = await c.put("/admin/routes/r-conf/evidence", json={"bench": {"p95": 2}})
        assert given.status_code == 200, given.text
        assert "bench" not in given.json()["checked"]
        assert given.json()["bench"] == {"p95": 2}
    shown = await asyncio.to_thread(cli, fleet, "evidence", "r-conf")
    assert "dep-canary: ok: " in shown.stdout, shown.stdout
    assert f"(measured on dep-canary={fp})" in shown.stdout
    assert 'bench: {"p95": 2} (as given)' in shown.stdout

    # The route changes while a run is under way: its attach is refused.
    changed = contract("r-conf", "dep-stable", "dep-canary")
    changed["candidates"][1].update(precision="fp8")
    r2 = await apply(fleet, changed)
    async with admin_http(fleet) as c:
        late = await c.put(
            "/admin/routes/r-conf/evidence",
            json={"conformance": {"dep-canary": {"ok": True}}, "covers": {"dep-canary": fp}},
        )
    assert late.status_code == 409, late.text
    assert r2["fingerprints"]["dep-canary"] in late.json()["error"]["message"]

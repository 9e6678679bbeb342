"""Rollouts through real NATS, Redis, simulators, a gateway and workers of
three deployments (docs/rollout.md): the canary split by class and tenant, the
ledger's arms, manual rollback to an earlier revision, and the status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.inference import rollout
from jetserve.fleet import Fleet, FleetSpec
from streams.routes import contract_from_builtins
from tests.refusals import checked_fleet
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(240)]

ROUTES = ("r-split", "r-back", "r-bad")
OTHER = "rollout-other"  # a second tenant, outside the canary's scope


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    aliases = [arg for name in ROUTES for arg in ("--alias", name)]
    spec = FleetSpec(workers=0, profile="fast", engine_per_worker=True, sim_args=aliases)
    with checked_fleet(request, spec) as f:
        f.start_worker("--deployment-name", "dep-stable")
        f.start_worker("--deployment-name", "dep-canary")
        yield f


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
        want = rollout.arm(canary.canary, "r-split", request_id, "interactive", tenant)
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

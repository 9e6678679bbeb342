"""Route contracts end to end: the admin API writes revisions into NATS KV, a
running gateway picks them up live, workers enforce the candidate list, and the
ledger records which revision and deployment served each request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats.errors
import pytest

from jetserve.commands.admin_client import AdminClient
from jetserve.fleet import Fleet, FleetSpec
from streams.auth import Role
from streams.routes import (
    ROUTES_BUCKET,
    RouteRecord,
    contract_from_builtins,
    encode,
    fingerprints,
)
from tests.refusals import checked_fleet
from tests.routes_cli import cli

pytestmark = pytest.mark.connected

# Each test owns one route (a simulator alias, so the engine serves the name).
ROUTES = ("r-apply", "r-live", "r-cand", "r-cli", "r-cas")


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    aliases = [arg for name in ROUTES for arg in ("--alias", name)]
    with checked_fleet(request, FleetSpec(workers=0, profile="fast", sim_args=aliases)) as f:
        f.start_worker("--deployment-name", "dep-a", "--deployment-engine", "jetserve-sim")
        f.start_worker("--deployment-name", "dep-b", "--deployment-hardware", "a100-sim")
        yield f


def contract(name: str, *deps: str, **over: Any) -> dict[str, Any]:
    cands = [
        {"name": d, "adapter": "openai", "engine": "jetserve-sim", "model": name} for d in deps
    ]
    return {"name": name, "candidates": cands, **over}


def admin_http(fleet: Fleet, token: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=fleet.admin_url,
        headers={"Authorization": f"Bearer {fleet.admin_token if token is None else token}"},
        timeout=10,
    )


def chat(fleet: Fleet, model: str, max_tokens: int = 4, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}],
        },
        headers={"Authorization": f"Bearer {fleet.api_key}", **headers},
        timeout=30,
    )


def ledger(fleet: Fleet, route: str) -> list[dict[str, Any]]:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    return [r for r in map(json.loads, text.splitlines()) if r["route"] == route]


def test_apply_revisions_history_and_diff(fleet: Fleet) -> None:
    with admin_http(fleet) as c:
        first = c.put("/admin/routes/r-apply", json=contract("r-apply", "dep-a"))
        assert first.status_code == 201, first.text
        assert first.json()["revision"] == 1
        assert first.json()["changed"] is True
        fp1 = first.json()["fingerprints"]["dep-a"]

        again = c.put("/admin/routes/r-apply", json=contract("r-apply", "dep-a"))
        assert again.status_code == 200
        assert again.json()["changed"] is False
        assert again.json()["revision"] == 1

        second = c.put("/admin/routes/r-apply", json=contract("r-apply", "dep-a", deadline_s=5))
        assert second.status_code == 200
        assert second.json()["revision"] == 2
        assert second.json()["fingerprints"]["dep-a"] != fp1

        history = c.get("/admin/routes/r-apply/history").json()["data"]
        assert [h["revision"] for h in history] == [1, 2]
        assert [h["contract"]["deadline_s"] for h in history] == [60.0, 5.0]

        diff = c.get("/admin/routes/r-apply/diff").json()
        assert (diff["from"], diff["to"]) == (1, 2)
        assert diff["changes"] == [{"path": "deadline_s", "before": 60.0, "after": 5.0}]
        assert c.get("/admin/routes/r-apply/diff", params={"from": 2, "to": 1}).json()[
            "changes"
        ] == [{"path": "deadline_s", "before": 5.0, "after": 60.0}]
        assert c.get("/admin/routes/r-apply/diff", params={"from": 9}).status_code == 404

        listed = {r["name"]: r for r in c.get("/admin/routes").json()["data"]}
        assert listed["r-apply"]["revision"] == 2
        assert listed["r-apply"]["fingerprints"] == second.json()["fingerprints"]

        # Bad input: OpenAI-shaped 400s naming the problem.
        for body, param in [
            (contract("other-name", "dep-a"), "name"),
            (contract("r-apply"), "candidates"),
            (contract("r-apply", "dep-a", "dep-a"), None),
            ({**contract("r-apply", "dep-a"), "surprise": 1}, None),
            (contract("r-apply", "dep-a", deadline_s=-1), "deadline_s"),
        ]:
            bad = c.put("/admin/routes/r-apply", json=body)
            assert bad.status_code == 400, bad.text
            err = bad.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert err["message"]
            if param is not None:
                assert err["param"] == param
        assert c.get("/admin/routes/r-apply").json()["revision"] == 2  # nothing written

        assert c.delete("/admin/routes/r-apply").json()["deleted"] is True
        assert c.get("/admin/routes/r-apply").status_code == 404
        # Numbering continues after a delete: a revision never names two contracts.
        back = c.put("/admin/routes/r-apply", json=contract("r-apply", "dep-a"))
        assert back.status_code == 201
        assert back.json()["revision"] == 3
        kinds = [
            h.get("deleted", False) for h in c.get("/admin/routes/r-apply/history").json()["data"]
        ]
        assert kinds == [False, False, True, False]


def test_compare_and_set_conflict_is_409(fleet: Fleet) -> None:
    with admin_http(fleet) as c:
        assert c.put("/admin/routes/r-cas", json=contract("r-cas", "dep-a")).status_code == 201
        ok = c.put(
            "/admin/routes/r-cas",
            json={**contract("r-cas", "dep-a", deadline_s=9), "expected_revision": 1},
        )
        assert ok.status_code == 200
        assert ok.json()["revision"] == 2
        # A second admin still working from revision 1 loses, and is told the current one.
        stale = c.put(
            "/admin/routes/r-cas",
            json={**contract("r-cas", "dep-a", deadline_s=8), "expected_revision": 1},
        )
        assert stale.status_code == 409
        assert stale.json()["current_revision"] == 2
        assert stale.json()["error"]["code"] == "route_conflict"
        assert c.get("/admin/routes/r-cas").json()["contract"]["deadline_s"] == 9.0
        gone = c.delete("/admin/routes/r-cas", params={"expected_revision": 1})
        assert gone.status_code == 409


def test_a_route_name_that_is_no_kv_key_or_an_admin_path_is_a_400(fleet: Fleet) -> None:
    """Taken as it was, a name like ``a..b`` failed every KV write: 503 "route store
    unavailable"; ``x/evidence`` was routed to route x's evidence."""
    with admin_http(fleet) as c:
        for name in ("a..b", "a.", "x/evidence"):
            r = c.put(f"/admin/routes/{name}", json=contract(name, "dep-a"))
            assert r.status_code == 400, (name, r.text)
            assert "name" in r.json()["error"]["message"], r.text


def test_admin_bodies_too_deep_or_too_big_are_the_callers_fault(fleet: Fleet) -> None:
    """A deeply nested admin body got a plain-text 500 (the decoder's recursion
    bound); evidence over the store's message size a retryable 503 "unavailable"."""
    nested = b"[" * 100_000 + b"]" * 100_000
    headers = {"Content-Type": "application/json"}
    with admin_http(fleet) as c:
        assert c.put("/admin/routes/r-big", json=contract("r-big", "dep-a")).status_code == 201
        for method, path, field in (
            ("POST", "/admin/tenants", b"x"),
            ("POST", "/admin/keys", b"x"),
            ("PUT", "/admin/routes/r-deep", b"x"),
            ("PUT", "/admin/routes/r-big/evidence", b"bench"),  # its fields only
        ):
            deep = b'{"' + field + b'": {"x": ' + nested + b"}}"
            r = c.request(method, path, content=deep, headers=headers)
            assert r.status_code == 400, (path, r.text[:200])
            assert "nested too deeply" in r.json()["error"]["message"], (path, r.text[:200])
        big = {"conformance": {"dep-a": {"blob": "x" * 1_500_000}}}
        r = c.put("/admin/routes/r-big/evidence", json=big)
        assert r.status_code == 413, r.text[:300]


def test_admin_routes_need_the_admin_token(fleet: Fleet) -> None:
    with admin_http(fleet, token="wrong") as c:
        assert c.get("/admin/routes").status_code == 401
        put = c.put("/admin/routes/r-x", json=contract("r-x", "dep-a"))
        assert put.status_code == 401
        assert put.json()["error"]["code"] == "invalid_admin_token"
    # The public port has no admin routes at all.
    r = httpx.get(
        f"{fleet.base_url}/admin/routes", headers={"Authorization": f"Bearer {fleet.api_key}"}
    )
    assert r.status_code == 404


def test_gateway_picks_up_a_change_live_and_the_ledger_names_it(fleet: Fleet) -> None:
    # No route yet: the gateway serves only its --models list.
    assert chat(fleet, "r-live").status_code == 404
    slow = {"X-Sim-Fault": "slow:150"}  # 8 tokens: ~1.2 s of generation
    with admin_http(fleet) as c:
        tight = c.put(
            "/admin/routes/r-live", json=contract("r-live", "dep-a", "dep-b", deadline_s=0.5)
        )
        assert tight.status_code == 201
        # A longer client timeout does not lengthen the route's deadline: under
        # the client's 20 s its ~1.2 s of generation would answer 200 (as below,
        # once the route allows 30 s); the route's 0.5 s ends it 504. (Not timed:
        # a loaded box once took 1.507 s to deliver the 504.)
        r = chat(fleet, "r-live", 8, **slow, **{"X-Jetserve-Timeout": "20"})
        assert r.status_code == 504, r.text

        loose = c.put(
            "/admin/routes/r-live", json=contract("r-live", "dep-a", "dep-b", deadline_s=30)
        )
        assert loose.json()["revision"] == 2
        ok = chat(fleet, "r-live", 8, **slow)  # same gateway, no restart
        assert ok.status_code == 200, ok.text
        fps = loose.json()["fingerprints"]
        models = [
            m["id"]
            for m in httpx.get(
                f"{fleet.base_url}/v1/models", headers={"Authorization": f"Bearer {fleet.api_key}"}
            ).json()["data"]
        ]
        assert "r-live" in models

    records = ledger(fleet, "r-live")
    served = [r for r in records if r["status"] == 200]
    timed_out = [r for r in records if r["status"] == 504]
    assert len(served) == 1
    assert len(timed_out) == 1
    assert served[0]["route_revision"] == 2
    assert timed_out[0]["route_revision"] == 1
    assert served[0]["deployment"] in ("dep-a", "dep-b")
    assert served[0]["fingerprint"] == fps[served[0]["deployment"]]


def test_only_a_candidate_deployment_serves(fleet: Fleet) -> None:
    with admin_http(fleet) as c:
        applied = c.put("/admin/routes/r-cand", json=contract("r-cand", "dep-b"))
        assert applied.status_code == 201
    for _ in range(8):
        r = chat(fleet, "r-cand")
        assert r.status_code == 200, r.text
    records = ledger(fleet, "r-cand")
    assert len(records) == 8
    assert {r["deployment"] for r in records} == {"dep-b"}
    assert {r["fingerprint"] for r in records} == {applied.json()["fingerprints"]["dep-b"]}


def test_cli_apply_diff_history(fleet: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "r-cli.yaml"
    path.write_text(
        "name: r-cli\ncandidates:\n"
        "  - {name: dep-a, adapter: openai, engine: jetserve-sim, model: r-cli}\n"
        "retry:\n  on: [engine_unavailable]\n"
    )
    first = cli(fleet, "apply", str(path))
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == "revision 1"
    assert cli(fleet, "apply", str(path)).stdout.splitlines()[0] == "unchanged at revision 1"

    path.write_text(path.read_text() + "deadline_s: 12.5\n")
    assert cli(fleet, "apply", str(path)).stdout.splitlines()[0] == "revision 2"

    diff = cli(fleet, "diff", "r-cli")
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout == "--- r-cli r1\n+++ r-cli r2\n- deadline_s: 60.0\n+ deadline_s: 12.5\n"
    history = cli(fleet, "history", "r-cli").stdout.splitlines()
    assert [line.split()[0] for line in history] == ["r1", "r2"]
    assert "r-cli\trevision 2" in cli(fleet, "list").stdout
    assert json.loads(cli(fleet, "show", "r-cli").stdout)["contract"]["deadline_s"] == 12.5

    stale = cli(fleet, "apply", str(path), "--expected-revision", "1")
    assert stale.returncode == 1
    assert "409" in stale.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(contract("r-cli", "dep-a", deadline_s="soon")))
    refused = cli(fleet, "apply", str(bad))
    assert refused.returncode == 1
    assert "400" in refused.stderr
    assert "deadline_s" in refused.stderr
    assert cli(fleet, "delete", "r-cli").stdout.startswith("deleted r-cli")


def load_record(name: str) -> bytes:
    """A valid record of a route no test asks for: the load writes these."""
    c = contract_from_builtins(contract(name, "dep-load"))
    fps = fingerprints(c)
    return encode(
        RouteRecord(contract=c, revision=1, updated_at=0.0, updated_by="load", fingerprints=fps)
    )


@contextlib.contextmanager
def bus_load(fleet: Fleet, route: str) -> Iterator[list[int]]:
    """Load while the block runs, on the routes bucket's own stream (the
    watch-based reads went short when that stream's delivery lagged behind its
    API replies): puts of 16 other routes, watches (ordered consumers made and
    dropped) on ``route``, and history reads on every gateway's admin API.
    Yields the count of put rounds done (a list, so the caller can check it)."""
    rounds = [0]
    started: concurrent.futures.Future[None] = concurrent.futures.Future()
    stop = threading.Event()

    async def main() -> None:
        nc = await fleet.connect(Role.ADMIN, name="bus-load")
        try:
            routes = await nc.jetstream().key_value(ROUTES_BUCKET)
            blobs = {f"load-{j}": load_record(f"load-{j}") for j in range(16)}

            async def puts() -> None:
                while not stop.is_set():
                    await asyncio.gather(*(routes.put(k, v) for k, v in blobs.items()))
                    rounds[0] += 1
                    if not started.done():
                        started.set_result(None)

            async def watches() -> None:
                while not stop.is_set():
                    with contextlib.suppress(nats.errors.Error):  # NoKeysError: the old bug
                        await routes.history(route)

            async def admin_reads(port: int) -> None:
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}",
                    headers={"Authorization": f"Bearer {fleet.admin_token}"},
                    timeout=30,
                ) as c:
                    while not stop.is_set():
                        await c.get(f"/admin/routes/{route}/history")

            await asyncio.gather(
                *(puts() for _ in range(3)),
                watches(),
                *(admin_reads(port) for port in fleet.admin_ports),
            )
        finally:
            await nc.close()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bus-load") as pool:
        running = pool.submit(asyncio.run, main())
        try:
            concurrent.futures.wait([started, running], 30, concurrent.futures.FIRST_COMPLETED)
            if running.done():
                running.result()  # its failure, raised here
            assert started.done(), "the load never started"
            yield rounds
        finally:
            stop.set()
        running.result(30)


@pytest.mark.timeout(240)
def test_every_apply_is_read_back_at_once_on_the_other_replica(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Read-your-writes: each apply on one replica is seen at once by show, diff,
    history and list on the other, under load; revisions are 1, 2, ... with no
    number reused across a delete."""
    f = make_fleet(gateways=2, workers=0)
    assert len(f.admin_ports) == 2
    admins = [AdminClient(f"http://127.0.0.1:{p}", f.admin_token) for p in f.admin_ports]
    name, n = "r-ryw", 24
    try:
        with bus_load(f, name) as rounds:
            for i in range(1, n + 1):
                writer, reader = admins[i % 2], admins[(i + 1) % 2]
                out = writer.apply_route(contract(name, "dep-a", deadline_s=float(i)))
                assert out["changed"] is True
                assert out["revision"] == i
                shown = reader.show_route(name)
                assert shown["revision"] == i
                assert shown["contract"]["deadline_s"] == float(i)
                history = reader.route_history(name)
                assert [h["revision"] for h in history] == list(range(1, i + 1))
                diff = reader.route_diff(name)
                assert (diff["from"], diff["to"]) == (i - 1 if i > 1 else None, i)
                if i > 1:
                    assert diff["changes"] == [
                        {"path": "deadline_s", "before": float(i - 1), "after": float(i)}
                    ]
                assert {r["name"]: r["revision"] for r in reader.list_routes()}[name] == i

            # A delete on one replica, a new apply on the other: numbering goes on.
            gone = admins[0].delete_route(name)
            assert gone["revision"] == n
            assert name not in {r["name"] for r in admins[1].list_routes()}
            back = admins[1].apply_route(contract(name, "dep-a", deadline_s=99.0))
            assert back["revision"] == n + 1
            history = admins[0].route_history(name)
            assert [h.get("revision") for h in history] == [*range(1, n + 1), None, n + 1]
            assert history[n]["deleted"] is True
            assert admins[0].show_route(name)["revision"] == n + 1
        assert rounds[0] > 0
    finally:
        for a in admins:
            a.close()

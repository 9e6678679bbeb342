"""LoRA adapters as models (issue 17, item 6), through real processes: two
simulator replicas, one of them serving the adapter ``sql-lora`` (``jetserve sim
--lora``). Workers read it from their engine's /v1/models and advertise it;
the gateway lists it with its ``parent``, sends its requests only to the replica
that holds it (its adapter pool) and the base model's to either, and refuses an
adapter no live replica holds. /v1/models lists only what live workers serve."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet, FleetSpec
from tests.refusals import checked_fleet
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(180)]

ADAPTER = "sql-lora"
# Long enough for prefix affinity: the adapter pool's own lanes take it.
LONG_SYSTEM = "You translate questions into SQL for the shop's reporting database. " * 6


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    spec = FleetSpec(
        workers=0,
        profile="fast",
        engine_per_worker=True,
        # Configured, but no engine serves it: /v1/models must leave it out.
        gateway_args=["--embedding-models", "sim-embed,nobody-embeds-this"],
    )
    with checked_fleet(request, spec) as f:
        f.start_worker(sim_args=["--lora", ADAPTER])  # worker 0 holds the adapter
        f.start_worker()  # worker 1: the base model only
        yield f


def auth(fleet: Fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.api_key}"}


async def chat(c: httpx.AsyncClient, fleet: Fleet, model: str, system: str = "") -> httpx.Response:
    messages = [{"role": "system", "content": system}] if system else []
    return await c.post(
        f"{fleet.base_url}/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": 6,
            "seed": 1,
            "messages": [*messages, {"role": "user", "content": "top customers"}],
        },
        headers=auth(fleet),
    )


def ledger(fleet: Fleet) -> dict[str, dict[str, Any]]:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    return {r["request_id"]: r for r in map(json.loads, text.splitlines())}


async def listed(c: httpx.AsyncClient, fleet: Fleet) -> dict[str, dict[str, Any]]:
    r = await c.get(f"{fleet.base_url}/v1/models", headers=auth(fleet))
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


async def test_adapter_requests_reach_only_the_replica_that_holds_it(fleet: Fleet) -> None:
    holder, other = (f"worker{n}-" for n in range(2))
    async with httpx.AsyncClient(timeout=60) as c:

        async def adapter_listed() -> bool:
            return ADAPTER in await listed(c, fleet)

        await until(adapter_listed, "the gateway listing the adapter")
        models = await listed(c, fleet)
        assert models[ADAPTER]["parent"] == "sim-8b"
        assert models["sim-8b"]["parent"] is None
        # Configured and served; configured but served by no live worker: left out.
        assert "sim-embed" in models
        assert "nobody-embeds-this" not in models

        replies = await asyncio.gather(
            *(chat(c, fleet, ADAPTER) for _ in range(6)),
            *(chat(c, fleet, ADAPTER, LONG_SYSTEM) for _ in range(4)),
        )
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        adapter_ids = [r.headers["x-request-id"] for r in replies]
        # The engine ran the adapter: its text is not the base model's.
        base_reply = await chat(c, fleet, "sim-8b")
        assert base_reply.status_code == 200, base_reply.text
        text = replies[0].json()["choices"][0]["message"]["content"]
        assert text != base_reply.json()["choices"][0]["message"]["content"]
        assert replies[0].json()["model"] == ADAPTER

        # The base model goes to either replica: wait until both have served it.
        base_ids: list[str] = []

        async def both_served_base() -> bool:
            rs = await asyncio.gather(*(chat(c, fleet, "sim-8b") for _ in range(8)))
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            base_ids.extend(r.headers["x-request-id"] for r in rs)
            workers = {ledger(fleet)[i]["worker"][: len(holder)] for i in base_ids}
            return workers == {holder, other}

        await until(both_served_base, "base-model requests served by both replicas")

        # An adapter nobody serves, and no route lists: 404, as for any model.
        missing = await chat(c, fleet, "ghost-lora")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"

    records = ledger(fleet)
    served = [records[i] for i in adapter_ids]
    assert {r["model"] for r in served} == {ADAPTER}
    assert {r["worker"][: len(holder)] for r in served} == {holder}


async def test_a_route_lists_adapters(fleet: Fleet) -> None:
    """A route's adapters run under its policy on its candidates' workers that
    hold them; one that no live worker holds is refused with 503 and a reason."""
    contract = {
        "name": "r-lora",
        "candidates": [
            {"name": "sim-8b", "adapter": "openai", "engine": "jetserve-sim", "model": "sim-8b"}
        ],
        "adapters": [ADAPTER, "ghost-lora"],
    }
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.put(
            f"{fleet.admin_url}/admin/routes/r-lora",
            json=contract,
            headers={"Authorization": f"Bearer {fleet.admin_token}"},
        )
        assert r.status_code in (200, 201), r.text
        assert r.json()["contract"]["adapters"] == [ADAPTER, "ghost-lora"]
        replies = await asyncio.gather(*(chat(c, fleet, ADAPTER) for _ in range(6)))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        ghost = await chat(c, fleet, "ghost-lora")
        assert ghost.status_code == 503, ghost.text
        error = ghost.json()["error"]
        assert error["code"] == "adapter_unavailable"
        assert "ghost-lora" in error["message"]
    records = ledger(fleet)
    routed = [records[r.headers["x-request-id"]] for r in replies]
    assert {(r["route"], r["deployment"], r["model"]) for r in routed} == {
        ("r-lora", "sim-8b", ADAPTER)
    }
    assert {r["worker"].split("-")[0] for r in routed} == {"worker0"}


async def test_an_adapter_loaded_at_run_time_is_served_without_a_restart(fleet: Fleet) -> None:
    """vLLM loads and unloads LoRA adapters while it runs (/v1/load_lora_adapter):
    the worker in front of it follows, its pool is pulled (or no longer), and the
    gateway lists and routes (or refuses) the adapter, with nothing restarted."""
    engine = f"http://127.0.0.1:{fleet.worker_sim_ports[1]}"  # worker 1: the base model only
    hot = {"lora_name": "hot-lora", "lora_path": "/adapters/hot-lora"}
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(f"{engine}/v1/load_lora_adapter", json=hot)
        assert r.status_code == 200, r.text

        async def hot_listed() -> bool:
            return (await listed(c, fleet)).get("hot-lora", {}).get("parent") == "sim-8b"

        await until(hot_listed, "the gateway listing the adapter loaded at run time")

        async def hot_served() -> bool:
            return (await chat(c, fleet, "hot-lora")).status_code == 200

        await until(hot_served, "the adapter's pool pulled by the worker that now holds it")
        replies = await asyncio.gather(*(chat(c, fleet, "hot-lora") for _ in range(4)))
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        records = ledger(fleet)
        workers = {records[r.headers["x-request-id"]]["worker"].split("-")[0] for r in replies}
        assert workers == {"worker1"}

        r = await c.post(f"{engine}/v1/unload_lora_adapter", json={"lora_name": "hot-lora"})
        assert r.status_code == 200, r.text

        async def hot_gone() -> bool:
            return "hot-lora" not in await listed(c, fleet)

        await until(hot_gone, "the gateway dropping the unloaded adapter")
        gone = await chat(c, fleet, "hot-lora")
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["code"] == "model_not_found"


async def test_a_key_scoped_to_some_models_lists_only_those(fleet: Fleet) -> None:
    """A key scoped to one model (a tenant's own adapter, say) is shown that one:
    /v1/models listed the whole fleet's names, other tenants' adapters included."""
    async with httpx.AsyncClient(timeout=60) as c:

        async def adapter_listed() -> bool:
            return ADAPTER in await listed(c, fleet)

        await until(adapter_listed, "the gateway listing the adapter")
        with fleet.admin() as admin:
            scoped = admin.create_key(fleet.spec.tenant, "one-model", {"models": [ADAPTER]})
        r = await c.get(
            f"{fleet.base_url}/v1/models", headers={"Authorization": f"Bearer {scoped['api_key']}"}
        )
    assert r.status_code == 200, r.text
    assert [m["id"] for m in r.json()["data"]] == [ADAPTER]

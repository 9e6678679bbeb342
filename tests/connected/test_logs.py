"""Structured logs (issue 17): at info, the gateway and the worker write one JSON
object per line for every refusal, engine error, cancel, redelivery and dead
letter, with the request id, tenant, class and worker; never prompt or
completion text."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.fleet_logs import events
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = pytest.mark.connected

SECRET = "zebra quartz prompt words"


def find(fleet: Fleet, name: str, event: str, request_id: str) -> dict[str, Any] | None:
    for e in events(fleet, name):
        if e.get("event") == event and e.get("request_id") == request_id:
            return e
    return None


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-8b",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": SECRET}],
        **extra,
    }


async def test_refusals_errors_cancels_and_dead_letters_are_json_events(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1, log_level="info")
    url = f"{fleet.base_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=60) as c:
        bad_key = await c.post(url, json=body(), headers={"Authorization": "Bearer sk-wrong"})
        assert bad_key.status_code == 401
        # Refused before a request id exists: the caller's tenant and class are known.
        unknown = await c.post(url, json=body(model="no-such-model"), headers=auth)
        assert unknown.status_code == 404
        # Every attempt fails before the first token: redelivered, then dead-lettered.
        failing = await c.post(url, json=body(), headers={**auth, "X-Sim-Fault": "500"})
        assert failing.status_code >= 500
        failed_id = failing.headers.get("X-Request-Id") or ""
        # A client that hangs up mid-stream: the worker cancels the engine call.
        async with c.stream(
            "POST", url, json=body(stream=True), headers={**auth, "X-Sim-Fault": "slow:50"}
        ) as r:
            cancelled_id = r.headers["X-Request-Id"]
            lines = r.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass

    async def logged() -> bool:
        return all(
            find(fleet, name, event, rid) is not None
            for name, event, rid in [
                ("worker0", "cancelled", cancelled_id),
                ("gateway0", "ended", cancelled_id),
            ]
        )

    await until(logged, "the cancel logged by the worker and the gateway")
    gateway, worker = events(fleet, "gateway0"), events(fleet, "worker0")
    assert any(e.get("event") == "http_error" and e["status"] == 401 for e in gateway)
    refused = [e for e in gateway if e.get("event") == "refused" and e["status"] == 404]
    assert len(refused) == 1
    assert refused[0]["code"] == "model_not_found"
    assert (refused[0]["tenant"], refused[0]["cls"]) == (fleet.spec.tenant, "interactive")
    assert refused[0]["gateway"]
    cancel = find(fleet, "worker0", "cancelled", cancelled_id)
    assert cancel is not None
    assert (cancel["tenant"], cancel["cls"]) == (fleet.spec.tenant, "interactive")
    assert cancel["worker"]
    assert cancel["started"] is True
    errors = [e for e in worker if e.get("event") == "engine_error"]
    assert errors
    assert all(e["code"] == "engine_unavailable" and e["tenant"] for e in errors)
    assert any(e.get("event") == "redelivered" for e in worker)
    dead = [e for e in worker if e.get("event") == "dead_lettered"]
    assert len(dead) == 1
    if failed_id:
        assert dead[0]["request_id"] == failed_id
    ended = find(fleet, "gateway0", "ended", cancelled_id)
    assert ended is not None
    assert ended["outcome"] == "cancelled"  # the hang-up, as the ledger records it
    for name in ("gateway0", "worker0"):
        assert SECRET not in (fleet.workdir / f"{name}.log").read_text()
    # Nor the engine's error text (an engine may echo the prompt in it): the
    # dead letter's reason quoted it, and was logged whole.
    assert "Internal server error (simulated)" not in (fleet.workdir / "worker0.log").read_text()
    # Nor does the client get it: a 5xx body may be a proxy's page or a traceback.
    assert failing.json()["error"]["message"] == (
        "The engine is unavailable (HTTP 502); retry later."
    ), failing.json()


async def test_an_unreachable_engine_is_named_in_the_log_not_to_the_client(
    make_fleet: Callable[..., Fleet],
) -> None:
    # The client got "engine unreachable: ConnectionRefusedError(111, "Connect call
    # failed ('127.0.0.1', <port>)")": the engine's address. The worker's log has it.
    fleet = make_fleet(workers=1, log_level="info")
    assert fleet.sim is not None
    fleet.sim.stop()
    port = str(fleet.sim_port)
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json=body(),
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_unavailable"
    assert error["message"] == "The engine is unavailable (HTTP 503); retry later."
    assert port not in r.text
    rid = r.headers["X-Request-Id"]
    logged = find(fleet, "worker0", "engine_error", rid)
    assert logged is not None
    assert "unreachable" in logged["detail"]
    assert port in logged["detail"]


@pytest.mark.timeout(180)
async def test_a_worker_held_at_its_cap_while_the_engine_has_room_says_so(
    make_fleet: Callable[..., Fleet],
) -> None:
    """A worker serving --max-inflight requests while its engine queues nothing and
    has KV to spare counts that time and says so in its log once: the engine's
    batch is the worker's cap, not the engine's (the simulator takes 64 at once)."""
    fleet = make_fleet(workers=1, log_level="info", worker_args=["--max-inflight", "4"])
    url = f"{fleet.base_url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:50"}
    metrics = f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics"
    async with contextlib.AsyncExitStack() as stack:
        c = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
        # 1,000 tokens at 50 ms each (no early end of sequence): in flight all along.
        long = body(stream=True, max_tokens=1000, ignore_eos=True)
        for _ in range(4):
            r = await stack.enter_async_context(c.stream("POST", url, json=long, headers=headers))
            assert r.status_code == 200

        async def capped() -> bool:
            text = (await c.get(metrics)).text
            counted = metric_sum(text, "jetserve_worker_capped_seconds_total") > 0
            return counted and any(e.get("event") == "capped" for e in events(fleet, "worker0"))

        await until(capped, "the worker's capped time and its log line", 60.0)
    said = [e for e in events(fleet, "worker0") if e.get("event") == "capped"]
    assert len(said) == 1  # once, not at every look
    assert (said[0]["serving"], said[0]["max_inflight"], said[0]["engine_waiting"]) == (4, 4, 0)
    assert said[0]["worker"]
    assert "max_num_seqs" in said[0]["hint"]
    assert SECRET not in (fleet.workdir / "worker0.log").read_text()

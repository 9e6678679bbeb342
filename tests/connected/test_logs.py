"""Structured logs (issue 17): at info, the gateway and the worker write one JSON
object per line for every refusal, engine error, cancel, redelivery and dead
letter, with the request id, tenant, class and worker; never prompt or
completion text."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
import websockets

from jetserve.fleet import Fleet
from streams.auth import Role
from streams.subjects import INGRESS_CHAT
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


async def test_refusals_on_every_ingress_are_logged_with_the_tenant(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Refusals past authentication that left no line with the caller's tenant:
    # an Idempotency-Key's (over NATS: nothing at all), the agent runs API's (an
    # ``http_error`` line, no tenant, no run), and a WebSocket's messages (none).
    fleet = make_fleet(workers=1, log_level="info")
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    nc = await fleet.connect(Role.SERVICE, fleet.spec.tenant, "service")
    try:
        reply = await nc.request(
            INGRESS_CHAT,
            msgspec.json.encode(body()),
            timeout=30,
            headers={**auth, "Idempotency-Key": "k" * 300},
        )
    finally:
        await nc.close()
    assert reply.headers is not None
    assert reply.headers["Jetserve-Status"] == "400"
    async with httpx.AsyncClient(timeout=30, base_url=fleet.base_url) as c:
        missing = await c.get(f"/v1/runs/{'0' * 32}", headers=auth)
    assert missing.status_code == 404
    url = f"ws://127.0.0.1:{fleet.gateway_port}/v1/ws"
    async with websockets.connect(url, additional_headers=auth) as ws:
        await ws.send("{not json")
        frame = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 30))
    assert frame["type"] == "error"

    def refused() -> list[dict[str, Any]]:
        return [e for e in events(fleet, "gateway0") if e.get("event") == "refused"]

    async def all_three() -> bool:
        return len(await asyncio.to_thread(refused)) >= 3

    await until(all_three, "the three refusals logged")
    lines = refused()
    assert all(e["tenant"] == fleet.spec.tenant for e in lines), lines
    (key,) = [e for e in lines if e.get("request_id")]  # refused after its id was made
    assert (key["code"], key["cls"]) == ("invalid_request", "interactive")
    (run,) = [e for e in lines if e["code"] == "run_not_found"]
    assert (run["run_id"], run["action"]) == ("0" * 32, "get")
    (socket_line,) = [e for e in lines if e.get("ingress") == "websocket"]
    assert socket_line["code"] == "invalid_request"
    assert SECRET not in (fleet.workdir / "gateway0.log").read_text()


async def test_a_request_handed_back_at_the_end_of_a_drain_is_logged(
    make_fleet: Callable[..., Fleet],
) -> None:
    # A stopping worker's drain ends with a request that has emitted nothing: it
    # is handed back (nak) for another worker, and that was counted, not logged.
    fleet = make_fleet(workers=1, log_level="info", worker_args=["--grace", "1"])
    auth = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "stall:60000"}
    async with httpx.AsyncClient(timeout=120, base_url=fleet.base_url) as c:
        waiting = asyncio.ensure_future(c.post("/v1/chat/completions", json=body(), headers=auth))

        async def engine_has_it() -> bool:
            return int((await c.get(f"{fleet.sim_url}/sim/stats")).json()["records"]) >= 1

        await until(engine_has_it, "the engine holding the request")
        fleet.workers[0].signal(signal.SIGTERM)

        def handed_back() -> list[dict[str, Any]]:
            return [
                e
                for e in events(fleet, "worker0")
                if e.get("event") == "redelivered" and e.get("code") == "shutdown"
            ]

        async def logged() -> bool:
            return bool(await asyncio.to_thread(handed_back))

        await until(logged, "the hand-back logged")
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    (line,) = handed_back()
    assert (line["tenant"], line["cls"]) == (fleet.spec.tenant, "interactive")
    assert line["request_id"]

"""A gateway request whose answer was lost before its first token, through real
processes (streams/inference/frames.py, the lost-answer watch).

A worker acks a request at its first token; a NATS node that dies then can take
every frame of a short answer with it. Here the test itself is that worker: it
takes the request off the work queue, acks it and sends nothing. The client
must get a retryable 502 ``answer_lost`` within a few heartbeat timeouts (the
old gateway waited out the request's deadline), recorded once and charged
nothing. A request that is still queued is waited for; so is one a failing
worker handed on to the next candidate's pool (its heartbeat says where)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client
from nats.aio.msg import Msg

from gateway.tenancy.accounting import Accountant
from jetserve.fleet import Fleet
from streams.auth import Role
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import RequestClass
from streams.wire import Final, Token, Usage, decode_request, encode
from tests.scrape import metric_sum
from tests.waits import until

pytestmark = [pytest.mark.connected, pytest.mark.timeout(120)]

# The gateway's heartbeat timeout: a check after 2 s of silence, the answer lost
# after 2 s more. The request's own deadline (120 s) is past the test's timeout.
GATEWAY = ["--heartbeat-timeout", "2"]
CHAT = {"model": "sim-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _headers(fleet: Fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.api_key}", "X-Jetserve-Timeout": "120"}


async def _checks(fleet: Fleet, result: str) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(fleet.gateway_metrics_urls[0])).text
    return metric_sum(text, "jetserve_gateway_queue_checks_total", result=result)


def _ask(c: httpx.AsyncClient, fleet: Fleet, model: str = "sim-8b") -> asyncio.Task[httpx.Response]:
    """A chat request, under way: its answer, when it comes."""
    url = f"{fleet.base_url}/v1/chat/completions"
    return asyncio.create_task(c.post(url, json={**CHAT, "model": model}, headers=_headers(fleet)))


async def _take(worker: Client) -> Msg:
    """A worker's pull of the interactive class: the request's message."""
    sub = await worker.jetstream().pull_subscribe_bind(
        DEFAULT_TOPOLOGY.consumer_name(RequestClass.INTERACTIVE),
        DEFAULT_TOPOLOGY.stream_of(RequestClass.INTERACTIVE),
    )
    (msg,) = await sub.fetch(1, timeout=30)
    return msg


def _record(fleet: Fleet, request_id: str) -> dict[str, Any] | None:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    rows = [r for r in map(json.loads, text.splitlines()) if r["request_id"] == request_id]
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


async def test_a_taken_request_whose_answer_never_comes_is_a_retryable_502(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=0, gateway_args=GATEWAY)
    worker = await connect(fleet.nats_url, "taker", fleet.bus_auth(Role.WORKER))
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            asking = _ask(c, fleet)
            msg = await _take(worker)
            await msg.ack_sync()  # taken, as at a first token whose frames were all lost
            r = await asking
    finally:
        await worker.close()
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "answer_lost", error
    assert await _checks(fleet, "gone") == 1  # given up one heartbeat timeout after it
    request_id = r.headers["x-request-id"]

    rows: list[dict[str, Any]] = []

    async def recorded() -> bool:
        row = await asyncio.to_thread(_record, fleet, request_id)
        rows.extend([row] if row else [])
        return bool(rows)

    await until(recorded, "the lost request's ledger record")
    (row,) = rows
    assert (row["outcome"], row["status"], row["charge_micros"]) == ("answer_lost", 502, 0)
    rds = aioredis.Redis.from_url(fleet.redis_url)
    try:
        tenant = fleet.spec.tenant
        _, held = await Accountant(rds).spend("tenant", tenant, org=tenant)
    finally:
        await rds.aclose()
    assert held == 0  # its hold given back


async def test_an_answer_only_the_capture_kept_is_relayed_from_it(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The live subject dropped the whole short answer (this gateway reconnecting,
    a server dying between worker and gateway) and the capture kept it: before
    counting it lost, the gateway reads the capture, and answers from it."""
    fleet = make_fleet(workers=0, gateway_args=GATEWAY)
    worker = await connect(fleet.nats_url, "taker", fleet.bus_auth(Role.WORKER))
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            asking = _ask(c, fleet)
            msg = await _take(worker)
            reply = decode_request(msg.data).reply
            await msg.ack_sync()
            # To the capture only (the reply subject), never the live twin.
            await worker.publish(reply, encode(Token(seq=1, text="kept")))
            final = Final(seq=2, finish_reason="stop", usage=Usage(3, 1))
            await worker.publish(reply, encode(final))
            r = await asking
    finally:
        await worker.close()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "kept"
    assert r.json()["usage"]["completion_tokens"] == 1
    assert await _checks(fleet, "gone") == 1  # found gone, then read from the capture


async def test_a_committed_stream_ends_with_an_answer_lost_event(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Headers go out after 1 s in the queue: the loss comes after the commit.
    fleet = make_fleet(workers=0, gateway_args=[*GATEWAY, "--commit-after", "1"])
    worker = await connect(fleet.nats_url, "taker", fleet.bus_auth(Role.WORKER))
    events: list[dict[str, Any]] = []
    try:
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream(
                "POST",
                f"{fleet.base_url}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers=_headers(fleet),
            ) as r,
        ):
            assert r.status_code == 200  # committed while queued
            msg = await _take(worker)
            await msg.ack_sync()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    finally:
        await worker.close()
    assert [e["error"]["code"] for e in events if "error" in e] == ["answer_lost"], events
    assert not [e for e in events if e.get("choices")], events  # nothing was sent before it


async def test_a_request_still_queued_is_waited_for(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=0, gateway_args=GATEWAY)
    async with httpx.AsyncClient(timeout=60) as c:
        asking = _ask(c, fleet)

        async def checked_twice() -> bool:
            assert not asking.done(), asking
            return await _checks(fleet, "queued") >= 2

        await until(checked_twice, "two checks finding the request queued", 60.0)
        assert await _checks(fleet, "gone") == 0  # nothing takes it before the worker
        await asyncio.to_thread(fleet.start_worker)
        r = await asking
    assert r.status_code == 200, r.text


async def test_a_request_handed_on_to_the_next_pool_is_followed_there(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(
        workers=0,
        engine_per_worker=True,
        gateway_args=GATEWAY,
        sim_args=["--alias", "r-moved"],
    )
    # Every answer of dep-bad's engine is a 503 before any token: the worker
    # hands the request on to dep-late's pool, where no worker is yet.
    fleet.start_worker("--deployment-name", "dep-bad", sim_args=["--fault-rate", "503=1.0"])
    cands = [
        {"name": d, "adapter": "openai", "engine": "jetserve-sim", "model": "r-moved"}
        for d in ("dep-bad", "dep-late")
    ]
    async with httpx.AsyncClient(timeout=60) as c:
        put = await c.put(
            f"{fleet.admin_url}/admin/routes/r-moved",
            json={"name": "r-moved", "candidates": cands},
            headers={"Authorization": f"Bearer {fleet.admin_token}"},
        )
        assert put.status_code in (200, 201), put.text

        async def seen() -> bool:
            text = (await c.get(fleet.gateway_metrics_urls[0])).text
            return metric_sum(text, "jetserve_gateway_pool_workers", deployment="dep-bad") >= 1

        await until(seen, "the gateway seeing dep-bad's worker")
        asking = _ask(c, fleet, model="r-moved")

        async def handed_on() -> bool:
            url = f"http://127.0.0.1:{fleet.worker_metrics_ports[0]}/metrics"
            text = (await c.get(url)).text
            return metric_sum(text, "jetserve_worker_redeliveries_total", reason="fallback") >= 1

        await until(handed_on, "dep-bad's worker handing the request on")
        before = await _checks(fleet, "queued")

        async def followed() -> bool:
            assert not asking.done(), asking  # not given up on as lost
            return await _checks(fleet, "queued") >= before + 2

        # The original message is gone (ended by the hand-over): only the copy
        # in dep-late's pool, which the heartbeat named, can read as queued.
        await until(followed, "two checks finding the handed-on copy queued", 60.0)
        assert await _checks(fleet, "gone") == 0  # never the original's place
        await asyncio.to_thread(fleet.start_worker, "--deployment-name", "dep-late")
        r = await asking
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = []

    async def recorded() -> bool:
        row = await asyncio.to_thread(_record, fleet, r.headers["x-request-id"])
        rows.extend([row] if row else [])
        return bool(rows)

    await until(recorded, "the ledger record")
    assert rows[0]["deployment"] == "dep-late", rows

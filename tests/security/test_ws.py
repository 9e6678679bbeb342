"""The WebSocket edge against a real gateway process: refusals before accept (and
the gateway's memory under 1,000 of them), tickets, the bearer subprotocol,
``?api_key=`` off by default, and the per-socket limits (requests in flight,
message size, idle timeout, header count)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from gateway.ingress.openapi_types import WsTicket
from jetserve.fleet import Fleet, FleetSpec
from tests.refusals import checked_fleet
from tests.security.memory import MIB, Growth
from tests.waits import until

pytestmark = pytest.mark.connected

INFLIGHT = 2
MAX_MESSAGE = 64 * 1024
IDLE_S = 1.5
V1 = Subprotocol("jetserve.v1")
BODY = {"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# Long enough to still be streaming when a test is done with it (it cancels it).
LONG = {**BODY, "max_tokens": 400, "ignore_eos": True, "stream": True}
SLOW = {"X-Sim-Fault": "slow:100"}  # 100 ms a token (forwarded from the upgrade)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    limits = ["--ws-max-inflight", str(INFLIGHT), "--ws-max-message-bytes", str(MAX_MESSAGE)]
    spec = FleetSpec(
        workers=1, profile="fast", gateway_args=[*limits, "--ws-idle-timeout", str(IDLE_S)]
    )
    with checked_fleet(request, spec) as f:
        yield f


@pytest.fixture(scope="module")
def lenient_fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """``?api_key=`` allowed, and tickets that expire after 1 s; logging at debug,
    where uvicorn logs every upgrade and the websockets library its handshake."""
    spec = FleetSpec(
        workers=0,
        gateway_args=["--ws-allow-query-key", "--ws-ticket-ttl", "1"],
        log_level="debug",
    )
    with checked_fleet(request, spec) as f:
        yield f


def ws_url(fleet: Fleet, query: str = "") -> str:
    return fleet.base_url.replace("http://", "ws://", 1) + "/v1/ws" + query


def bearer(fleet: Fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.api_key}"}


async def new_ticket(fleet: Fleet) -> WsTicket:
    async with httpx.AsyncClient(timeout=10.0) as c:
        r = await c.post(f"{fleet.base_url}/v1/ws/tickets", headers=bearer(fleet))
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    return msgspec.json.decode(r.content, type=WsTicket)  # the documented shape, exactly


async def refusal(url: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """The status and error of an upgrade that must be refused (never accepted)."""
    with pytest.raises(InvalidStatus) as info:
        async with websockets.connect(url, open_timeout=10, **kwargs):
            pass
    response = info.value.response
    error: dict[str, Any] = msgspec.json.decode(response.body or b"{}").get("error", {})
    return response.status_code, error


async def send(ws: ClientConnection, **message: Any) -> None:
    await ws.send(msgspec.json.encode(message).decode())


async def next_for(ws: ClientConnection, rid: str) -> dict[str, Any]:
    """The next message for request ``rid`` (others' chunks are skipped)."""
    while True:
        msg: dict[str, Any] = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 20))
        if msg["id"] == rid:
            return msg


async def round_trip(ws: ClientConnection) -> None:
    await send(ws, type="request", id="rt", body=BODY)
    msg = await next_for(ws, "rt")
    assert msg["type"] == "response", msg
    assert msg["data"]["choices"][0]["message"]["content"]


# -- refused before accept -----------------------------------------------------------


async def test_1000_unauthenticated_connects_are_refused_and_memory_stays_flat(
    fleet: Fleet,
) -> None:
    unknown_ticket = "wst-" + "A" * 43  # well formed: costs a GETDEL
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("", {}),
        ("", {"additional_headers": {"Authorization": "Bearer sk-wrong"}}),
        ("?ticket=garbage", {}),
        (f"?ticket={unknown_ticket}", {}),
        (f"?api_key={fleet.api_key}", {}),  # a good key, in the URL: refused by default
        ("", {"subprotocols": [V1, Subprotocol("jetserve.bearer.sk-wrong")]}),
    ]

    async def attempt(i: int) -> int:
        query, kwargs = attempts[i % len(attempts)]
        status, _ = await refusal(ws_url(fleet, query), **kwargs)
        return status

    async def worker(n: int, first: int, statuses: list[int]) -> None:
        for i in range(first, first + n):
            statuses.append(await attempt(i))

    async def round_of(total: int, statuses: list[int]) -> None:
        async with asyncio.TaskGroup() as tg:  # 50 at a time
            for w in range(50):
                tg.create_task(worker(total // 50, w * total // 50, statuses))

    # A first round fills the allocator's pools and the per-connection free lists:
    # growth measured from a cold process is start-up, not a leak.
    warm: list[int] = []
    await round_of(300, warm)
    assert set(warm) == {401}
    growth = Growth(fleet.gateways[0].proc.pid)
    statuses: list[int] = []
    began = time.monotonic()
    await round_of(1000, statuses)
    took = time.monotonic() - began
    grown = growth.bytes()
    print(f"1000 refused upgrades in {took:.1f}s: gateway memory grew {grown / MIB:.2f} MiB")
    assert statuses == [401] * 1000
    assert grown < 20 * MIB


async def test_an_api_key_in_the_url_is_refused_by_default(fleet: Fleet) -> None:
    status, error = await refusal(ws_url(fleet, f"?api_key={fleet.api_key}"))
    assert (status, error["code"]) == (401, "query_key_disabled")
    # Even with a good header as well: a key in a URL is already leaked.
    status, error = await refusal(
        ws_url(fleet, f"?api_key={fleet.api_key}"), additional_headers=bearer(fleet)
    )
    assert (status, error["code"]) == (401, "query_key_disabled")


async def test_a_socket_without_a_credential_is_refused(fleet: Fleet) -> None:
    status, error = await refusal(ws_url(fleet))
    assert (status, error["code"]) == (401, "invalid_api_key")
    assert "ticket" in error["message"]


async def test_too_many_headers_on_the_upgrade_is_431(fleet: Fleet) -> None:
    pads = {f"x-pad-{i}": "1" for i in range(100)}
    status, error = await refusal(ws_url(fleet), additional_headers={**bearer(fleet), **pads})
    assert (status, error["code"]) == (431, "request_headers_too_large")


# -- tickets and the bearer subprotocol --------------------------------------------------


async def test_a_ticket_opens_one_socket_once(fleet: Fleet) -> None:
    ticket = await new_ticket(fleet)
    assert ticket.expires_in == 30
    async with websockets.connect(ws_url(fleet, f"?ticket={ticket.ticket}")) as ws:
        await round_trip(ws)
    status, error = await refusal(ws_url(fleet, f"?ticket={ticket.ticket}"))
    assert (status, error["code"]) == (401, "invalid_ticket")


async def test_a_ticket_in_the_bearer_subprotocol(fleet: Fleet) -> None:
    ticket = (await new_ticket(fleet)).ticket
    offered = [V1, Subprotocol(f"jetserve.bearer.{ticket}")]
    async with websockets.connect(ws_url(fleet), subprotocols=offered) as ws:
        assert ws.subprotocol == "jetserve.v1"
        assert ws.response is not None
        assert ws.response.headers["Sec-WebSocket-Protocol"] == "jetserve.v1"  # no secret
        await round_trip(ws)
    status, error = await refusal(ws_url(fleet), subprotocols=offered)
    assert (status, error["code"]) == (401, "invalid_ticket")


async def test_an_api_key_in_the_bearer_subprotocol(fleet: Fleet) -> None:
    offered = [Subprotocol(f"jetserve.bearer.{fleet.api_key}"), V1]
    async with websockets.connect(ws_url(fleet), subprotocols=offered) as ws:
        assert ws.subprotocol == "jetserve.v1"
        await round_trip(ws)


async def test_the_bearer_subprotocol_needs_v1_beside_it(fleet: Fleet) -> None:
    offered = [Subprotocol(f"jetserve.bearer.{fleet.api_key}")]
    status, error = await refusal(ws_url(fleet), subprotocols=offered)
    assert (status, error["code"]) == (400, "invalid_request")


@pytest.mark.parametrize(
    "ticket",
    ["wst-short", "wst-" + "B" * 43, "not-a-ticket"],
    ids=["malformed", "unknown", "not-a-ticket"],
)
async def test_unknown_tickets_are_refused(fleet: Fleet, ticket: str) -> None:
    status, error = await refusal(ws_url(fleet, f"?ticket={ticket}"))
    assert (status, error["code"]) == (401, "invalid_ticket")


async def test_the_ticket_endpoint_needs_a_key(fleet: Fleet) -> None:
    async with httpx.AsyncClient(timeout=10.0) as c:
        url = f"{fleet.base_url}/v1/ws/tickets"
        assert (await c.post(url)).status_code == 401
        wrong = await c.post(url, headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"


async def test_an_expired_ticket_is_refused(lenient_fleet: Fleet) -> None:
    # Tickets of this fleet live 1 s. Each probe spends one ticket of a batch issued
    # together, so the first refusal says the batch has expired, unused.
    batch = [await new_ticket(lenient_fleet) for _ in range(40)]
    assert batch[0].expires_in == 1
    for probe in batch:
        try:
            async with websockets.connect(ws_url(lenient_fleet, f"?ticket={probe.ticket}")):
                pass
        except InvalidStatus as exc:
            refused = exc.response
            break
        await asyncio.sleep(0.25)  # a polling interval: the next probe is the next look
    else:
        raise AssertionError("40 tickets of 1 s still valid after 10 s of probing")
    error = msgspec.json.decode(refused.body or b"{}")["error"]
    assert (refused.status_code, error["code"]) == (401, "invalid_ticket")


async def test_an_api_key_in_the_url_when_allowed(lenient_fleet: Fleet) -> None:
    async with websockets.connect(ws_url(lenient_fleet, f"?api_key={lenient_fleet.api_key}")):
        pass


# -- limits of an open socket --------------------------------------------------------------


async def test_credentials_in_upgrade_urls_stay_out_of_the_log(lenient_fleet: Fleet) -> None:
    # uvicorn logs each upgrade at info with its query string: a ticket, or an
    # API key where ``?api_key=`` is allowed, landed in the gateway's log.
    log = lenient_fleet.workdir / "gateway0.log"

    async def upgrades() -> int:  # uvicorn's lines, each with the URL's path
        text = await asyncio.to_thread(log.read_text)
        return text.count("WebSocket /v1/ws?") + text.count("WebSocket /v1/ws ")

    before = await upgrades()
    ticket = (await new_ticket(lenient_fleet)).ticket
    wrong = "sk-js-" + "W" * 40
    async with websockets.connect(ws_url(lenient_fleet, f"?api_key={lenient_fleet.api_key}")):
        pass
    async with websockets.connect(ws_url(lenient_fleet, f"?ticket={ticket}")):
        pass
    status, _ = await refusal(ws_url(lenient_fleet, f"?api_key={wrong}"))
    assert status == 401

    async def logged() -> bool:  # the refused upgrade's line is the last of the three
        return await upgrades() >= before + 3

    await until(logged, "the three upgrades logged")
    text = log.read_text()
    for secret in (lenient_fleet.api_key, ticket, wrong):
        assert secret not in text


async def test_requests_past_the_inflight_cap_get_429_and_the_socket_stays(fleet: Fleet) -> None:
    async with websockets.connect(
        ws_url(fleet), additional_headers={**bearer(fleet), **SLOW}
    ) as ws:
        for rid in ("a", "b"):
            await send(ws, type="request", id=rid, body=LONG)
        await send(ws, type="request", id="c", body=LONG)
        refused = await next_for(ws, "c")
        assert refused["type"] == "error", refused
        assert refused["status"] == 429
        assert refused["error"]["code"] == "too_many_inflight"
        # The two in flight stream on; a finished (here: cancelled) one frees a place.
        assert (await next_for(ws, "a"))["type"] == "chunk"
        await send(ws, type="cancel", id="a")
        await send(ws, type="request", id="d", body={**BODY, "max_tokens": 1})
        assert (await next_for(ws, "d"))["type"] == "response"
        await send(ws, type="cancel", id="b")


async def test_a_message_over_the_limit_closes_with_1009(fleet: Fleet) -> None:
    async with websockets.connect(ws_url(fleet), additional_headers=bearer(fleet)) as ws:
        await ws.send("x" * (MAX_MESSAGE - 16))  # under: read, and answered as bad JSON
        under = await next_for(ws, "")
        assert (under["type"], under["status"]) == ("error", 400)
        await ws.send("x" * (MAX_MESSAGE + 1))
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 20)
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 1009


async def test_an_idle_socket_is_closed(fleet: Fleet) -> None:
    async with websockets.connect(ws_url(fleet), additional_headers=bearer(fleet)) as ws:
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 30)  # a generous bound on a 1.5 s timeout
    assert info.value.rcvd is not None
    assert (info.value.rcvd.code, info.value.rcvd.reason) == (1000, "idle timeout")


async def test_a_request_in_flight_keeps_a_socket_open(fleet: Fleet) -> None:
    # 25 tokens at 100 ms: the answer comes after the idle timeout has passed.
    async with websockets.connect(
        ws_url(fleet), additional_headers={**bearer(fleet), **SLOW}
    ) as ws:
        await send(ws, type="request", id="r", body={**BODY, "max_tokens": 25, "ignore_eos": True})
        answer = await next_for(ws, "r")
        assert answer["type"] == "response", answer
        assert answer["data"]["usage"]["completion_tokens"] == 25
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 30)  # and then idle: closed
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 1000

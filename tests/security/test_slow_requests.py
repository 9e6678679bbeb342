"""Slow requests (slowloris): a request's head and body must arrive within
``--request-read-timeout`` of its first byte (a new connection's, for its first),
or the gateway answers 408 and closes (gateway/ingress/http_protocol.py). Before,
a connection that sent nothing, or a byte now and then, held its socket for ever."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet, FleetSpec
from tests.refusals import checked_fleet

pytestmark = pytest.mark.connected


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    spec = FleetSpec(
        workers=0,
        profile="fast",
        gateway_args=["--request-read-timeout", "1", "--keep-alive-timeout", "1"],
    )
    with checked_fleet(request, spec) as f:
        yield f


async def _answer(fleet: Fleet, sent: bytes) -> bytes:
    """What the gateway says to a connection that sends ``sent`` and then
    nothing more, read to its close (the bound only turns a hang into a failure)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", fleet.gateway_port)
    try:
        writer.write(sent)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def _refusal(answer: bytes) -> dict[str, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert b"connection: close" in head.lower()
    error: dict[str, str] = msgspec.json.decode(body)["error"]
    return error


async def test_a_connection_that_sends_nothing_is_closed_with_408(fleet: Fleet) -> None:
    error = _refusal(await _answer(fleet, b""))
    assert error["code"] == "request_timeout"


async def test_a_head_that_never_ends_is_408(fleet: Fleet) -> None:
    partial = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
    assert _refusal(await _answer(fleet, partial))["code"] == "request_timeout"


async def test_a_body_that_never_ends_is_408(fleet: Fleet) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + fleet.api_key.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    assert _refusal(await _answer(fleet, head + b'{"model":'))["code"] == "request_timeout"


async def test_whole_requests_on_a_kept_connection_are_served(fleet: Fleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.base_url) as c:
        for _ in range(3):  # one connection, each request whole at once
            r = await c.get("/v1/models", headers={"Authorization": f"Bearer {fleet.api_key}"})
            assert r.status_code == 200, r.text


async def test_a_kept_connection_idle_past_keep_alive_is_closed_quietly(fleet: Fleet) -> None:
    # ``--keep-alive-timeout`` bounds an idle connection between requests (uvicorn's own 5 s
    # was a client pool's too, httpx's: a reuse raced the close and got a reset).
    reader, writer = await asyncio.open_connection("127.0.0.1", fleet.gateway_port)
    try:
        writer.write(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + fleet.api_key.encode() + b"\r\n\r\n"
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        # Then nothing: the gateway closes, without an answer (not a 408).
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()


async def test_a_client_that_leaves_mid_body_leaves_no_traceback(fleet: Fleet) -> None:
    """Gone while its body arrived (and at the 408, whose refusal closes the body
    under the app): the app's read raised ClientDisconnect, logged as "Exception in
    ASGI application" with a traceback each time, at any client's will."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + fleet.api_key.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    _, writer = await asyncio.open_connection("127.0.0.1", fleet.gateway_port)
    writer.write(head + b'{"model":')
    await writer.drain()
    writer.close()  # gone, the body half sent
    await writer.wait_closed()
    assert _refusal(await _answer(fleet, head + b'{"model":'))["code"] == "request_timeout"
    async with httpx.AsyncClient(base_url=fleet.base_url) as c:  # still serving
        r = await c.get("/v1/models", headers={"Authorization": f"Bearer {fleet.api_key}"})
        assert r.status_code == 200
    log = (fleet.workdir / "gateway0.log").read_text()
    assert "Exception in ASGI application" not in log
    assert "ClientDisconnect" not in log

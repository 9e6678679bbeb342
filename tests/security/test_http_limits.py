"""HTTP limits before any work, against a real gateway process: the body cap (413,
whether the length is declared or not), the header-count cap and the bound on the
request head (431). The gateway's memory is read from /proc while 100 MB bodies
and a 10 MiB header are thrown at it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet, FleetSpec
from tests.connected.test_bridges import _books
from tests.refusals import checked_fleet
from tests.security.memory import MIB, Growth
from tests.waits import until

pytestmark = pytest.mark.connected

CAP = 4 * MIB  # the default --max-body-bytes
HUGE = 100 * 1000 * 1000  # 100 MB
CHUNK = 64 * 1024
RSS_BOUND = 20 * MIB


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    # No worker: nothing here may reach one.
    with checked_fleet(request, FleetSpec(workers=0, profile="fast")) as f:
        yield f


async def body(total: int) -> AsyncIterator[bytes]:
    """``total`` bytes, made as they are sent: the client holds one chunk."""
    chunk = b"x" * CHUNK
    sent = 0
    while sent < total:
        piece = chunk[: total - sent]
        sent += len(piece)
        yield piece


def error_of(r: httpx.Response) -> dict[str, str]:
    err: dict[str, str] = msgspec.json.decode(r.content)["error"]
    return err


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as c:
        yield c


def gateway_pid(fleet: Fleet) -> int:
    return fleet.gateways[0].proc.pid


@pytest.fixture(scope="module")
def warm(fleet: Fleet) -> Fleet:
    """A first pass through each refusal path (imports, caches, the allocator's
    arenas) before memory is measured."""
    url = f"{fleet.base_url}/v1/chat/completions"
    with httpx.Client(timeout=30.0) as c:
        assert c.post(url, content=iter([b"x" * (CAP + 1)])).status_code == 413
        assert c.post(url, content=b"x" * (CAP + 1)).status_code == 413
        assert c.get(url, headers={"X-Pad": "y" * 100_000}).status_code == 431
    return fleet


async def test_a_chunked_100mb_body_is_cut_at_the_cap(
    warm: Fleet, client: httpx.AsyncClient
) -> None:
    fleet = warm
    growth = Growth(gateway_pid(fleet))
    # No Authorization header: the cap comes before the key (413, not 401).
    r = await client.post(f"{fleet.base_url}/v1/chat/completions", content=body(HUGE))
    grown = growth.bytes()
    print(f"chunked 100 MB: gateway memory grew {grown / MIB:.2f} MiB")
    assert r.status_code == 413
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    assert error_of(r)["code"] == "request_too_large"
    assert r.headers["connection"] == "close"
    assert grown < RSS_BOUND


async def test_a_declared_100mb_body_is_refused_unread(
    warm: Fleet, client: httpx.AsyncClient
) -> None:
    fleet = warm
    growth = Growth(gateway_pid(fleet))
    r = await client.post(
        f"{fleet.base_url}/v1/chat/completions",
        content=body(HUGE),
        headers={"Content-Length": str(HUGE)},
    )
    grown = growth.bytes()
    print(f"Content-Length 100 MB: gateway memory grew {grown / MIB:.2f} MiB")
    assert r.status_code == 413
    assert r.request.headers["content-length"] == str(HUGE)
    err = error_of(r)
    assert err["code"] == "request_too_large"
    assert str(HUGE) in err["message"]  # refused on the declared length
    assert r.headers["connection"] == "close"
    assert grown < RSS_BOUND


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_the_cap_is_exact(fleet: Fleet, client: httpx.AsyncClient, chunked: bool) -> None:
    url = f"{fleet.base_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {fleet.api_key}"}

    def content(n: int) -> bytes | AsyncIterator[bytes]:
        return body(n) if chunked else b"x" * n

    at_cap = await client.post(url, content=content(CAP), headers=auth)
    # Read and parsed: not JSON, so a 400 from the app, not the cap's 413.
    assert at_cap.status_code == 400, at_cap.text
    over = await client.post(url, content=content(CAP + 1), headers=auth)
    assert over.status_code == 413, over.text


async def test_the_admin_port_has_the_cap_too(fleet: Fleet, client: httpx.AsyncClient) -> None:
    r = await client.post(
        f"{fleet.admin_url}/admin/tenants",
        content=body(HUGE),
        headers={"Content-Length": str(HUGE)},
    )
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"


def padded(client: httpx.AsyncClient, url: str, api_key: str, total: int) -> httpx.Request:
    """GET ``url`` with exactly ``total`` request headers (httpx's own included)."""
    request = client.build_request("GET", url, headers={"Authorization": f"Bearer {api_key}"})
    for i in range(total - len(request.headers.raw)):
        request.headers[f"x-pad-{i}"] = "1"
    assert len(request.headers.raw) == total
    return request


async def test_header_count_cap(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = f"{fleet.base_url}/v1/models"
    ok = await client.send(padded(client, url, fleet.api_key, 100))
    assert ok.status_code == 200, ok.text
    over = await client.send(padded(client, url, fleet.api_key, 101))
    assert over.status_code == 431
    assert error_of(over)["code"] == "request_headers_too_large"
    assert over.headers["connection"] == "close"


async def test_a_long_header_is_refused(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = f"{fleet.base_url}/v1/models"
    auth = f"Bearer {fleet.api_key}"
    fits = await client.get(url, headers={"Authorization": auth, "X-Pad": "y" * 32_000})
    assert fits.status_code == 200, fits.text
    r = await client.get(url, headers={"Authorization": auth, "X-Pad": "y" * 100_000})
    assert r.status_code == 431
    assert error_of(r)["code"] == "request_headers_too_large"


async def test_a_10mib_header_leaves_memory_flat(warm: Fleet, client: httpx.AsyncClient) -> None:
    fleet = warm
    growth = Growth(gateway_pid(fleet))
    r = await client.get(f"{fleet.base_url}/v1/models", headers={"X-Pad": "y" * (10 * MIB)})
    grown = growth.bytes()
    print(f"10 MiB header: gateway memory grew {grown / MIB:.2f} MiB")
    assert r.status_code == 431
    assert grown < RSS_BOUND


async def test_a_pipelined_head_over_the_bound_does_not_break_the_stream_before_it(
    make_fleet: Callable[..., Fleet],
) -> None:
    """While a streamed answer is being written, the client pipelines a request
    whose head is over the bound. The 431 was written into the middle of the
    stream's body; the stream's next write then failed with a RuntimeError that
    ended it with no outcome (no ledger record, its hold left to the orphan
    sweep). Now the connection is closed (nothing can be said in order) and the
    streamed request ends as a client that left: one record (cancelled), no hold."""
    fleet = make_fleet(workers=1)
    body = msgspec.json.encode({
        "model": "sim-8b", "stream": True, "max_tokens": 3000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "pipelined"}],
    })  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", fleet.gateway_port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + fleet.api_key.encode()
            + b"\r\nX-Sim-Fault: slow:10\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        got = b""
        while b"data: " not in got:
            got += await asyncio.wait_for(reader.read(65536), 30)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70_000)
        rest = b""
        while piece := await asyncio.wait_for(reader.read(65536), 60):  # closed: b""
            rest += piece
        assert b"431" not in rest  # never inside the stream
    finally:
        writer.close()

    async def recorded() -> bool:
        rows, reserved = await asyncio.to_thread(_books, fleet)
        return len(rows) == 1 and reserved == 0

    await until(recorded, "the streamed request's one record and its hold given back")
    rows, _ = await asyncio.to_thread(_books, fleet)
    assert rows[0]["outcome"] == "cancelled", rows  # the hang-up, as the ledger records it

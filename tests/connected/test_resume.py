"""Resumable streams: Last-Event-ID on the same replica, through another replica
after the first is killed, and never across tenants."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import msgspec
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected

BODY = {
    "model": "sim-8b",
    "stream": True,
    "max_tokens": 40,
    "messages": [{"role": "user", "content": "a story worth resuming"}],
}


def reference(fleet: Fleet) -> str:
    r = httpx.post(f"{fleet.sim_url}/v1/chat/completions", json={**BODY, "stream": False})
    return str(r.json()["choices"][0]["message"]["content"])


async def read_events(
    response: httpx.Response, stop_after: int | None = None
) -> tuple[list[str], int, bool, dict[str, object] | None]:
    """(texts, last event id, saw [DONE], error) of an SSE response."""
    texts: list[str] = []
    last_id, pending_id, done, error = 0, 0, False, None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            pending_id = int(line[4:])  # counts once its data arrived, as in EventSource
        elif line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            chunk = msgspec.json.decode(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                break
            texts.extend(ch["delta"].get("content") or "" for ch in chunk["choices"])
            last_id = pending_id
            if stop_after is not None and len([t for t in texts if t]) >= stop_after:
                break
    return texts, last_id, done, error


def ledger_records(fleet: Fleet, request_id: str) -> list[dict[str, object]]:
    with fleet.admin() as admin:
        text = admin.ledger(fleet.spec.tenant)
    rows = [msgspec.json.decode(x) for x in text.splitlines() if x]
    return [r for r in rows if r["request_id"] == request_id]


async def test_resume_after_disconnect_on_the_same_replica(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1, gateway_args=["--resume-grace", "5"])
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:25"}
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream(
            "POST", f"{fleet.base_url}/v1/chat/completions", json=BODY, headers=headers
        ) as r:
            request_id = r.headers["x-request-id"]
            first, last_id, _, _ = await read_events(r, stop_after=5)
        assert last_id > 0
        async with c.stream(
            "GET",
            f"{fleet.base_url}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {fleet.api_key}", "Last-Event-ID": str(last_id)},
        ) as r2:
            assert r2.status_code == 200
            rest, _, done, error = await read_events(r2)
    assert error is None
    assert done
    assert "".join(first) + "".join(rest) == reference(fleet)
    await _await_ledger(fleet, request_id)


async def _await_ledger(fleet: Fleet, request_id: str) -> None:
    import asyncio

    for _ in range(100):
        rows = ledger_records(fleet, request_id)
        if rows:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a second writer, if any, would have landed by now
    rows = ledger_records(fleet, request_id)
    assert len(rows) == 1, rows
    assert rows[0]["outcome"] in ("length", "stop"), rows


async def test_resume_through_another_replica_after_a_gateway_dies(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(gateways=2, workers=1)
    gw0 = fleet.gateways[0]
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:25"}
    async with httpx.AsyncClient(timeout=30) as c:
        texts: list[str] = []
        last_id = 0
        request_id = ""

        async def read_until_the_replica_dies() -> None:
            nonlocal last_id, request_id
            async with c.stream(
                "POST", f"{fleet.base_urls[0]}/v1/chat/completions", json=BODY, headers=headers
            ) as r:
                request_id = r.headers["x-request-id"]
                pending_id = 0
                async for line in r.aiter_lines():
                    if line.startswith("id: "):
                        pending_id = int(line[4:])
                    elif line.startswith("data: ") and line != "data: [DONE]":
                        chunk = msgspec.json.decode(line[6:])
                        texts.extend(ch["delta"].get("content") or "" for ch in chunk["choices"])
                        last_id = pending_id
                        if len([t for t in texts if t]) >= 5 and gw0.proc.poll() is None:
                            gw0.kill()  # the replica dies with the client attached

        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await read_until_the_replica_dies()
        async with c.stream(
            "GET",
            f"{fleet.base_urls[1]}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {fleet.api_key}", "Last-Event-ID": str(last_id)},
        ) as r2:
            assert r2.status_code == 200
            rest, _, done, error = await read_events(r2)
    assert error is None
    assert done
    assert "".join(texts) + "".join(rest) == reference(fleet)
    await _await_ledger(fleet, request_id)  # the resuming replica kept the books


async def test_another_tenant_cannot_resume(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        admin.create_tenant("intruder")
        other = admin.create_key("intruder")["api_key"]
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream(
            "POST",
            f"{fleet.base_url}/v1/chat/completions",
            json={**BODY, "max_tokens": 5},
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        ) as r:
            request_id = r.headers["x-request-id"]
            await r.aread()
        denied = await c.get(
            f"{fleet.base_url}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {other}"},
        )
        mine = await c.get(
            f"{fleet.base_url}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {fleet.api_key}", "Last-Event-ID": "0"},
        )
    assert denied.status_code == 404
    assert denied.json()["error"]["code"] == "stream_not_found"
    assert mine.status_code == 200
    assert "data: [DONE]" in mine.text  # a full replay

"""Resumable streams: Last-Event-ID on the same replica, through another replica
after the first is killed, and never across tenants; and after every single
event of a stream (SSE or WebSocket), each on the other replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import websockets

from gateway.inference.service import MAX_RESUMES
from jetserve.fleet import Fleet, FleetSpec
from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import frames_filter
from tests.refusals import assert_no_refusals
from tests.scrape import metric_sum
from tests.waits import until, until_streamed, until_sync
from workers.inference.relay import CAPTURE_EVERY_S

pytestmark = pytest.mark.connected

BODY = {
    "model": "sim-8b",
    "stream": True,
    "max_tokens": 40,
    "messages": [{"role": "user", "content": "a story worth resuming"}],
}


def reference(fleet: Fleet, body: dict[str, Any] | None = None) -> str:
    body = body or {**BODY, "stream": False}
    r = httpx.post(f"{fleet.sim_url}/v1/chat/completions", json=body)
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


async def test_a_stream_that_ends_in_its_resume_grace_is_answered_and_resumable(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The client leaves after two tokens; its stream runs on, unread by any
    client, for longer than the gateway's frame buffer (1,024 frames), and ends
    within the resume grace. The gateway reads it meanwhile: the engine finishes
    (it was cancelled as a too-slow client once the unread buffer filled), the
    request is recorded answered, and a resume after the end gets the rest."""
    fleet = make_fleet(workers=1, gateway_args=["--resume-grace", "30"])
    # Paced (2 ms a token): unpaced, 1,500 tokens outrun even a reading client.
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:2"}
    body = {**BODY, "max_tokens": 1500, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream(
            "POST", f"{fleet.base_url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            request_id = r.headers["x-request-id"]
            first, last_id, _, _ = await read_events(r, stop_after=2)
        record: dict[str, Any] = {}

        async def engine_done() -> bool:
            nonlocal record
            got = await c.get(f"{fleet.sim_url}/sim/requests/{request_id}")
            record = got.json() if got.status_code == 200 else {}
            return record.get("status") in ("finished", "aborted")

        await until(engine_done, "the engine ending the unread stream")
        assert record["status"] == "finished", record
        async with c.stream(
            "GET",
            f"{fleet.base_url}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {fleet.api_key}", "Last-Event-ID": str(last_id)},
        ) as r2:
            rest, _, done, error = await read_events(r2)
    assert error is None
    assert done
    assert "".join(first) + "".join(rest) == reference(fleet, {**body, "stream": False})
    await _await_ledger(fleet, request_id)


async def _await_ledger(fleet: Fleet, request_id: str) -> None:
    """The request's one ledger record, read once every writer is done: each
    session of it (the original, each resume) settles apart, and the first to
    reach Redis records; a second record would be a later writer's."""
    await until_sync(lambda: ledger_records(fleet, request_id), f"{request_id}'s ledger record")
    await until(lambda: _books_settled(fleet), "every gateway's settlements applied")
    rows = ledger_records(fleet, request_id)
    assert len(rows) == 1, rows
    assert rows[0]["outcome"] in ("length", "stop"), rows


async def _books_settled(fleet: Fleet) -> bool:
    """On every live gateway nothing is in flight and every session that ended
    has had its settlement applied (counted inline, or deferred: left in the
    outbox), and the outbox holds nothing for a scanner to apply later."""
    async with httpx.AsyncClient(timeout=10) as c:
        for gw, url in zip(fleet.gateways, fleet.gateway_metrics_urls, strict=True):
            if gw.proc.poll() is not None:
                continue  # killed: its sessions are the other replicas' (or the sweep's)
            text = (await c.get(url)).text
            ended = metric_sum(text, "jetserve_gateway_requests_total")
            applied = sum(
                metric_sum(text, "jetserve_gateway_settlements_total", path=path)
                for path in ("inline", "deferred")
            )
            if metric_sum(text, "jetserve_gateway_inflight") or applied < ended:
                return False
    nc = await fleet.connect()
    try:
        info = await nc.jetstream().stream_info("JETSERVE_OUTBOX")
    finally:
        await nc.close()
    return info.state.messages == 0


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


# -- every event its own id: resume after each one, on the other replica ----------

CUT_BODY = {
    "model": "sim-8b",
    "stream": True,
    "temperature": 0,
    "max_tokens": 12,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "cut me after every event"}],
}

Chunk = tuple[int, dict[str, Any]]  # (event id, the chunk)


@pytest.fixture(scope="module")
def two_replicas(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """Two gateway replicas on one bus, shared by the cut-everywhere tests (read-only)."""
    with Fleet(FleetSpec(gateways=2, workers=1)) as f:
        yield f
    assert_no_refusals(request, f.violations())


def _text(chunks: list[Chunk]) -> str:
    return "".join(
        ch["delta"].get("content") or "" for _, chunk in chunks for ch in chunk["choices"]
    )


async def _sse_chunks(response: httpx.Response) -> tuple[list[Chunk], bool]:
    """(every chunk with its SSE id, saw [DONE]); an error event fails the test."""
    chunks: list[Chunk] = []
    pending_id, done = 0, False
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            pending_id = int(line[4:])
        elif line == "data: [DONE]":
            assert pending_id == 0, "[DONE] carries no id"
            done = True
        elif line.startswith("data: "):
            chunk = msgspec.json.decode(line[6:])
            assert "error" not in chunk, chunk
            assert pending_id > 0, f"a chunk without an id: {chunk}"
            chunks.append((pending_id, chunk))
            pending_id = 0
    return chunks, done


async def _resume_after_every_event(
    fleet: Fleet, c: httpx.AsyncClient, request_id: str, full: list[Chunk]
) -> None:
    """Resume after each event id of ``full`` on the second replica: each resume
    replays exactly what followed that event."""
    ids = [i for i, _ in full]
    assert ids == sorted(set(ids)), f"ids repeat or go back: {ids}"
    assert full[0][1]["choices"][0]["delta"].get("role") == "assistant"
    assert full[-1][1].get("usage"), "the usage chunk is the last one"
    whole = _text(full)
    plain = {k: v for k, v in CUT_BODY.items() if k not in ("stream", "stream_options")}
    assert whole == reference(fleet, plain)
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    for cut in ids:
        async with c.stream(
            "GET",
            f"{fleet.base_urls[1]}/v1/requests/{request_id}/stream",
            params={"include_usage": "true"},
            headers={**headers, "Last-Event-ID": str(cut)},
        ) as r:
            assert r.status_code == 200
            rest, done = await _sse_chunks(r)
        assert done, f"resume after {cut}: no [DONE]"
        before = [x for x in full if x[0] <= cut]
        assert _text(before) + _text(rest) == whole, f"resume after {cut}"
        got = [i for i, _ in rest]
        # Replayed from the capture the rest may come coalesced (fewer chunks),
        # but never with an id at or before the cut, a repeated one, or one the
        # stream does not have; and it ends where the stream ends.
        assert got == sorted(set(got)), (cut, got)
        assert all(i > cut and i in ids for i in got), (cut, got)
        assert got[-1:] == [i for i in ids[-1:] if i > cut], (cut, got)
        assert not any(ch["delta"].get("role") for _, x in rest for ch in x["choices"])
        for n, (i, _) in enumerate(rest):  # each id stands for the same place in the text
            through = _text(before) + _text(rest[: n + 1])
            assert through == _text([x for x in full if x[0] <= i]), (cut, i)
    await _await_ledger(fleet, request_id)  # resumed ~15 times, recorded once


async def test_resume_after_each_sse_event_on_another_replica(two_replicas: Fleet) -> None:
    fleet = two_replicas
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:15"}
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream(
            "POST", f"{fleet.base_urls[0]}/v1/chat/completions", json=CUT_BODY, headers=headers
        ) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            full, done = await _sse_chunks(r)
        assert done
        await _resume_after_every_event(fleet, c, request_id, full)


async def test_resume_after_each_websocket_chunk_over_http(two_replicas: Fleet) -> None:
    fleet = two_replicas
    url = fleet.base_urls[0].replace("http://", "ws://", 1) + "/v1/ws"
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:15"}
    full: list[Chunk] = []
    request_ids: set[str] = set()
    async with websockets.connect(url, additional_headers=headers) as ws:
        request = {"type": "request", "id": "w1", "body": CUT_BODY}
        await ws.send(msgspec.json.encode(request).decode())
        while True:
            msg = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 10))
            assert msg["id"] == "w1", msg
            if msg["type"] == "done":
                break
            assert msg["type"] == "chunk", msg
            request_ids.add(msg["request_id"])
            full.append((msg["event_id"], msg["data"]))
    assert len(request_ids) == 1
    (request_id,) = request_ids
    async with httpx.AsyncClient(timeout=30) as c:
        await _resume_after_every_event(fleet, c, request_id, full)


async def test_the_capture_keeps_tokens_batched_and_refuses_a_resume_past_its_start(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Tokens go live one by one but the frames capture keeps a message per
    quarter second (workers/inference/relay.py); a stream whose start the
    capture no longer holds is refused with 410 resume_window_exceeded, never
    answered with a partial text."""
    fleet = make_fleet(workers=1)
    headers = {"Authorization": f"Bearer {fleet.api_key}", "X-Sim-Fault": "slow:5"}
    body = {**BODY, "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream(
            "POST", f"{fleet.base_url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            request_id = r.headers["x-request-id"]
            started = asyncio.get_running_loop().time()
            texts, _, done, error = await read_events(r)
            elapsed = asyncio.get_running_loop().time() - started
        assert done, error
        assert "".join(texts) == reference(fleet, {**body, "stream": False})

        nc = await fleet.connect()
        try:
            js = nc.jetstream()
            topo = DEFAULT_TOPOLOGY
            subject = frames_filter(fleet.spec.tenant, request_id)
            info = await js.stream_info(topo.frames_stream, subjects_filter=subject)
            (captured,) = (info.state.subjects or {}).values()
            # Meta, the final frame, and one batch per quarter second at most.
            assert 3 <= captured <= 3 + elapsed / CAPTURE_EVERY_S, (captured, elapsed)
            assert captured < 200 / 4

            # The oldest frames go first: take the head away as the bound would.
            head = await js.get_msg(topo.frames_stream, seq=1, subject=subject, next=True)
            assert head.seq is not None
            await js.delete_msg(topo.frames_stream, head.seq)
        finally:
            await nc.close()
        r = await c.get(
            f"{fleet.base_url}/v1/requests/{request_id}/stream",
            headers={"Authorization": f"Bearer {fleet.api_key}", "Last-Event-ID": "10"},
        )
        assert r.status_code == 410, r.text
        assert r.json()["error"]["code"] == "resume_window_exceeded"


async def test_a_tenant_holds_a_bounded_number_of_resumes_open(fleet: Fleet) -> None:
    """Resumes, and Idempotency-Key retries that follow their first run, are free
    (no hold) and each keeps what it replays for as long as its client takes to
    read it: 150 that never read grew the gateway by ~1 MB each. A tenant holds at
    most MAX_RESUMES of them open on a replica; the next is a 429 until one ends."""
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    keyed = {**auth, "Idempotency-Key": "followed-0123456789"}
    limits = httpx.Limits(max_connections=MAX_RESUMES + 8)
    body = {**BODY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    chat = f"{fleet.base_url}/v1/chat/completions"
    async with (
        httpx.AsyncClient(timeout=60, limits=limits) as c,
        c.stream("POST", chat, json=body, headers={**keyed, "X-Sim-Fault": "slow:200"}) as r,
    ):
        url = f"{fleet.base_url}/v1/requests/{r.headers['x-request-id']}/stream"
        async with contextlib.AsyncExitStack() as held:
            for i in range(MAX_RESUMES):  # following the running stream, never read
                opened = (
                    c.stream("GET", url, headers=auth)
                    if i % 2
                    else c.stream("POST", chat, json=body, headers=keyed)  # its retries
                )
                followed = await held.enter_async_context(opened)
                assert followed.status_code == 200
            for over in (
                await c.get(url, headers=auth),
                await c.post(chat, json=body, headers=keyed),
            ):
                assert over.status_code == 429, over.text
                assert over.json()["error"]["code"] == "too_many_resumes"
        # All of them closed: resumes are served again once the gateway saw them end.
        await until_streamed(c, url, auth, "the closed resumes counted out")

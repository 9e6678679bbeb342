"""Fault injection, by request header and by seeded rate."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from tests.sim.simkit import SimHandle, StartSim, chat_body, sse
from tests.waits import until


@pytest.mark.parametrize(
    ("fault", "status", "kind"),
    [("429", 429, "RateLimitError"), ("503", 503, "ServiceUnavailableError"),
     ("500", 500, "InternalServerError")],
)  # fmt: skip
async def test_status_faults(fast: SimHandle, fault: str, status: int, kind: str) -> None:
    rid = uuid.uuid4().hex
    for path, body in [
        ("/v1/chat/completions", chat_body()),
        ("/v1/chat/completions", chat_body(stream=True)),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/embeddings", {"input": "hi"}),
    ]:
        r = await fast.client.post(
            path, json=body, headers={"X-Sim-Fault": fault, "X-Request-Id": rid}
        )
        assert r.status_code == status
        err = r.json()["error"]
        assert err["type"] == kind
        assert err["code"] == status
        assert err["message"]
        if status in (429, 503):
            assert r.headers["retry-after"] == "1"
    rec = await fast.record(rid)
    assert rec["status"] == "failed"
    assert rec["fault"] == fault
    stats = await fast.stats()
    assert stats["faults"] == {fault: 4}
    assert stats["failed"] == 4
    assert stats["started"] == 0


async def _read_until_error(
    client: httpx.AsyncClient, body: dict[str, Any], fault: str
) -> list[str]:
    lines: list[str] = []

    async def read() -> None:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Sim-Fault": fault}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():  # kept line by line: the stream breaks
                if line:
                    lines.append(line)

    with pytest.raises(httpx.RemoteProtocolError):
        await read()
    return lines


async def test_drop_mid_stream(fast: SimHandle) -> None:
    lines = await _read_until_error(fast.client, chat_body(stream=True, max_tokens=20), "drop:3")
    # Role chunk plus three content chunks, then the connection is cut: no finish, no [DONE].
    assert len(lines) == 4
    assert "[DONE]" not in "".join(lines)
    assert '"finish_reason":"' not in "".join(lines)
    stats = await fast.stats()
    assert stats["failed"] == 1
    assert stats["faults"] == {"drop:3": 1}
    assert stats["kv_blocks_used"] == 0
    assert stats["running"] == 0
    # The server keeps serving on fresh connections.
    assert (await fast.client.post("/v1/chat/completions", json=chat_body())).status_code == 200


async def test_drop_non_stream(fast: SimHandle) -> None:
    rid = uuid.uuid4().hex
    with pytest.raises(httpx.RemoteProtocolError):
        await fast.client.post(
            "/v1/chat/completions", json=chat_body(max_tokens=10),
            headers={"X-Sim-Fault": "drop:2", "X-Request-Id": rid},
        )  # fmt: skip
    rec = await fast.record(rid)
    assert rec["status"] == "failed"
    assert rec["generated_tokens"] == 2


async def test_stall_after_first_token_until_client_leaves(fast: SimHandle) -> None:
    rid = uuid.uuid4().hex
    got: list[str] = []
    async with fast.client.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True),
        headers={"X-Sim-Fault": "stall", "X-Request-Id": rid},
    ) as r:  # fmt: skip
        lines = r.aiter_lines()  # held: a dropped iterator would close the stream
        while len(got) < 2:  # the role chunk and one token
            if line := await anext(lines):
                got.append(line)
        # Then nothing: a request run to its end beside it (engine steps taken
        # after the stall) leaves it running at its one token.
        other = await fast.client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert other.status_code == 200
        rec = await fast.record(rid)
        assert (rec["status"], rec["generated_tokens"]) == ("running", 1), rec
    # The client left: the engine aborts it, still at one token.

    async def aborted() -> bool:
        nonlocal rec
        rec = await fast.record(rid)
        return bool(rec["status"] == "aborted")

    await until(aborted, "the stalled stream aborted")
    assert rec["generated_tokens"] == 1


async def test_stall_before_first_token(fast: SimHandle) -> None:
    t0 = time.perf_counter()
    s = await sse(
        fast.client, "/v1/chat/completions", chat_body(stream=True, max_tokens=2),
        headers={"X-Sim-Fault": "stall:250"},
    )  # fmt: skip
    assert s.done
    assert time.perf_counter() - t0 >= 0.25


async def test_slow_stream(fast: SimHandle) -> None:
    t0 = time.perf_counter()
    s = await sse(
        fast.client, "/v1/chat/completions", chat_body(stream=True, max_tokens=6),
        headers={"X-Sim-Fault": "slow:40"},
    )  # fmt: skip
    assert s.done
    assert time.perf_counter() - t0 >= 5 * 0.04  # 5 gaps between 6 tokens


async def test_bad_fault_header_is_400(fast: SimHandle) -> None:
    r = await fast.client.post(
        "/v1/chat/completions", json=chat_body(), headers={"X-Sim-Fault": "explode"}
    )
    assert r.status_code == 400


async def test_fault_rates_are_seeded_and_header_wins(start_sim: StartSim) -> None:
    async def statuses(h: SimHandle) -> list[int]:
        out = []
        for _ in range(30):
            r = await h.client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            out.append(r.status_code)
        return out

    a = await start_sim(profile="fast", seed=5, fault_rates={"429": 0.3, "503": 0.2})
    b = await start_sim(profile="fast", seed=5, fault_rates={"429": 0.3, "503": 0.2})
    sa, sb = await statuses(a), await statuses(b)
    assert sa == sb  # same seed, same fault sequence
    assert {200, 429, 503} == set(sa)
    always = await start_sim(profile="fast", fault_rates={"429": 1.0})
    assert (await always.client.post("/v1/chat/completions", json=chat_body())).status_code == 429
    opt_out = await always.client.post(
        "/v1/chat/completions", json=chat_body(), headers={"X-Sim-Fault": "none"}
    )
    assert opt_out.status_code == 200

"""Idempotency-Key retries across a gateway crash (issue 13, item 2): the request
id derives from (tenant, key), so a retry on another replica follows the first
run's frames instead of running again. The engine works once, the books get one
record and one charge, and the client gets the whole answer, streaming or not."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.tenancy.accounting import Accountant, Scope
from gateway.tenancy.idempotency import PREFIX, Claim, IdempotencyStore, Stored, key_hash
from jetserve.fleet import Fleet
from jetserve.services import Service
from tests.connected.test_resume import BODY, ledger_records, read_events, reference
from tests.scrape import metric_sum
from tests.tcp_cut import CutProxy
from tests.waits import until

pytestmark = pytest.mark.connected


async def sim_started(fleet: Fleet) -> int:
    async with httpx.AsyncClient() as c:
        return int((await c.get(f"{fleet.sim_url}/sim/stats")).json()["started"])


def spend(fleet: Fleet) -> tuple[int, int]:
    with fleet.admin() as admin:
        view = admin.get_limits("tenant", fleet.spec.tenant)
    return int(view["spent_micros"]), int(view["reserved_micros"])


def charged(rows: list[dict[str, Any]]) -> int:
    return sum(int(r["charge_micros"]) for r in rows)


def headers(fleet: Fleet, key: str, slow: bool = True) -> dict[str, str]:
    out = {"Authorization": f"Bearer {fleet.api_key}", "Idempotency-Key": key}
    if slow:
        out["X-Sim-Fault"] = "slow:25"  # long enough to kill its gateway mid-run
    return out


async def left_claim(
    fleet: Fleet, key: str, raw: bytes, owner: str = "", hold_s: float | None = None
) -> tuple[str, str]:
    """A first run's claim of ``key``, written as its gateway leaves it: made a
    minute ago (long past the takeover delay) by ``owner``, nothing queued; with
    ``hold_s``, its hold too (expiring that long from now). (key hash, request id)."""
    kh = key_hash(fleet.spec.tenant, key)
    request_id = f"{kh[:24]}{1:08x}"
    stored = Stored(
        "pending",
        hashlib.sha256(raw).hexdigest(),
        request_id=request_id,
        created=time.time() - 60,
        owner=owner,
    )
    rds = aioredis.Redis.from_url(fleet.redis_url)
    try:
        await rds.set(PREFIX + kh, msgspec.json.encode(stored), ex=600)
        await rds.set(PREFIX + "gen:" + kh, 1, ex=600)
        if hold_s is not None:
            org = fleet.spec.tenant  # a tenant's org is its own id unless named
            scope = Scope(org, fleet.spec.tenant, fleet.key_id)
            await Accountant(rds).reserve(scope, request_id, 10, 10, hold_s=hold_s)
    finally:
        await rds.aclose()
    return kh, request_id


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "sse"])
async def test_retry_after_the_gateway_dies_attaches_instead_of_running_again(
    make_fleet: Callable[..., Fleet], streaming: bool
) -> None:
    fleet = make_fleet(gateways=2, workers=1)
    gw0 = fleet.gateways[0]
    body = {**BODY, "stream": streaming}
    spent_before, _ = spend(fleet)
    started_before = await sim_started(fleet)
    key = f"crash-{streaming}"
    async with httpx.AsyncClient(timeout=30) as c:
        url0, url1 = (f"{u}/v1/chat/completions" for u in fleet.base_urls[:2])
        first = asyncio.create_task(c.post(url0, json=body, headers=headers(fleet, key)))

        async def engine_started() -> bool:
            return await sim_started(fleet) > started_before

        await until(engine_started, "the engine to start the first run")
        gw0.kill()  # published and running: its gateway dies
        with pytest.raises(httpx.TransportError):
            await first
        if streaming:
            async with c.stream("POST", url1, json=body, headers=headers(fleet, key)) as r:
                assert r.status_code == 200
                request_id = r.headers["x-request-id"]
                texts, _, done, error = await read_events(r)
            assert error is None
            assert done
            text = "".join(texts)
        else:
            r = await c.post(url1, json=body, headers=headers(fleet, key))
            assert r.status_code == 200, r.text
            request_id = r.headers["x-request-id"]
            text = r.json()["choices"][0]["message"]["content"]
        # A third try, after the run ended, is answered the same, still without running.
        if not streaming:
            again = await c.post(url1, json=body, headers=headers(fleet, key))
            assert again.headers["idempotent-replayed"] == "true"
            assert again.json() == r.json()
    assert await sim_started(fleet) - started_before == 1  # the engine worked once
    assert text == reference(fleet)
    rows = ledger_records(fleet, request_id)
    assert len(rows) == 1, rows
    assert rows[0]["outcome"] == "length"
    assert rows[0]["status"] == 200
    assert charged(rows) > 0
    spent, reserved = spend(fleet)
    assert spent - spent_before == charged(rows)  # one charge, the recorded one
    assert reserved == 0


async def test_a_claim_whose_gateway_died_before_queueing_is_taken_over(fleet: Fleet) -> None:
    """The first run claimed the key and died before it queued anything (a state
    written here as that gateway left it): a retry runs it, under the claim's
    request id, once."""
    raw = msgspec.json.encode({**BODY, "stream": False})
    key = "died-before-queueing"
    _, request_id = await left_claim(fleet, key, raw)  # a claim from before owners
    started_before = await sim_started(fleet)
    hdrs = {**headers(fleet, key, slow=False), "Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=30) as c:
        url = f"{fleet.base_url}/v1/chat/completions"
        r = await c.post(url, content=raw, headers=hdrs)
        again = await c.post(url, content=raw, headers=hdrs)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == request_id
    assert again.headers["idempotent-replayed"] == "true"
    assert await sim_started(fleet) - started_before == 1
    assert len(ledger_records(fleet, request_id)) == 1


async def test_a_claim_whose_owner_is_still_admitting_it_is_not_taken_over(
    fleet: Fleet,
) -> None:
    """The first run claimed the key long ago and is still being admitted (a
    fair gate's wait, a slow hold: written here as its gateway does, the claim and
    its owner's "still admitting" mark, kept fresh). A retry must not run it
    beside it; it used to, after 5 s. Once the owner falls silent (its gateway
    died), the retry takes it over."""
    raw = msgspec.json.encode({**BODY, "stream": False})
    key, owner = "still-admitting", "0123456789abcdef"
    kh, request_id = await left_claim(fleet, key, raw, owner)
    rds = aioredis.Redis.from_url(fleet.redis_url)
    alive = PREFIX + "alive:" + kh
    try:
        await rds.set(alive, owner, px=5000)
        started_before = await sim_started(fleet)
        hdrs = {**headers(fleet, key, slow=False), "Content-Type": "application/json"}
        async with httpx.AsyncClient(timeout=60) as c:
            url = f"{fleet.base_url}/v1/chat/completions"
            retry = asyncio.create_task(c.post(url, content=raw, headers=hdrs))
            # Twice the takeover delay, the owner saying it is alive every second.
            for _ in range(10):
                await rds.set(alive, owner, px=5000)
                await asyncio.sleep(1.0)
            assert not retry.done()  # it follows, it does not take over
            assert await sim_started(fleet) == started_before
            await rds.delete(alive)  # the owner's gateway died
            r = await retry
    finally:
        await rds.aclose()
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == request_id
    assert await sim_started(fleet) - started_before == 1


async def test_two_retries_never_both_take_a_claim_over(fleet: Fleet) -> None:
    """A takeover is a compare-and-set on the claim as it was read: of two retries
    that found the same dead first run, one owns it, the other finds it changed
    (it used to own it too: both ran it, and the loser's release freed the key)."""
    raw = msgspec.json.encode({**BODY, "stream": False})
    kh, request_id = await left_claim(fleet, "taken-twice", raw, "00112233aabbccdd")
    rds = aioredis.Redis.from_url(fleet.redis_url)
    try:
        store = IdempotencyStore(rds, ttl_s=600)
        found = Claim(
            request_id, kh, attach=True, created=time.time() - 60, seen="00112233aabbccdd"
        )
        first = await store.take_over(found)
        second = await store.take_over(found)  # found the same dead owner: taken since
    finally:
        await rds.aclose()
    assert first is not None
    assert first.owner
    assert second is None


async def test_a_retry_waits_for_an_admitting_first_run_only_to_its_own_deadline(
    fleet: Fleet,
) -> None:
    raw = msgspec.json.encode({**BODY, "stream": False})
    key, owner = "admitting-past-my-deadline", "8899aabbccddeeff"
    kh, _ = await left_claim(fleet, key, raw, owner)
    rds = aioredis.Redis.from_url(fleet.redis_url)
    try:
        await rds.set(PREFIX + "alive:" + kh, owner, px=60_000)  # alive all along
        hdrs = {
            **headers(fleet, key, slow=False),
            "Content-Type": "application/json",
            "X-Jetserve-Timeout": "2",
        }
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{fleet.base_url}/v1/chat/completions", content=raw, headers=hdrs)
    finally:
        await rds.aclose()
    assert r.status_code == 504, r.text  # it polled past it, for as long as the owner lived


async def test_a_takeover_of_a_run_the_sweep_recorded_starts_the_keys_next_run(
    fleet: Fleet,
) -> None:
    """The first run's gateway died after its hold and before queueing; past the
    hold's expiry the orphan sweep recorded it, settling its request id. A retry
    that takes the claim over finds that id spent: it used to answer 400
    ``duplicate_request`` and store it, so every retry of the key got that 400
    for the rest of the window. Now 409 ``idempotency_conflict`` (retryable), the
    claim released, and the next retry runs, under the key's next id."""
    raw = msgspec.json.encode({**BODY, "stream": False})
    key = "swept-before-queueing"
    kh, request_id = await left_claim(fleet, key, raw, "fedcba9876543210", hold_s=1)
    rds = aioredis.Redis.from_url(fleet.redis_url)
    try:  # what the sweep does
        await Accountant(rds).reconcile(request_id, 0, org=fleet.spec.tenant)
    finally:
        await rds.aclose()
    started_before = await sim_started(fleet)
    hdrs = {**headers(fleet, key, slow=False), "Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=30) as c:
        url = f"{fleet.base_url}/v1/chat/completions"
        r = await c.post(url, content=raw, headers=hdrs)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "idempotency_conflict"
        again = await c.post(url, content=raw, headers=hdrs)
    assert again.status_code == 200, again.text
    assert again.headers["x-request-id"] == f"{kh[:24]}{2:08x}"
    assert await sim_started(fleet) - started_before == 1


async def test_a_takeover_ends_before_the_first_runs_hold_expires(fleet: Fleet) -> None:
    """The first run's gateway died after its hold and before queueing. The retry
    that takes it over holds that hold, whose expiry the first run's deadline
    set: the retry's run is cut to end before it (less the sweep's grace), or the
    orphan sweep would settle it as lost while it ran (a 200 recorded as 502)."""
    raw = msgspec.json.encode({**BODY, "stream": False})
    key = "held-then-died"
    # The first run's hold: its expiry 1 s past the sweep's grace (60 s).
    await left_claim(fleet, key, raw, "0f1e2d3c4b5a6978", hold_s=61)
    hdrs = {
        **headers(fleet, key, slow=False),
        "X-Sim-Fault": "slow:100",  # 40 tokens: 4 s, past the 1 s the hold leaves
        "Content-Type": "application/json",
    }
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{fleet.base_url}/v1/chat/completions", content=raw, headers=hdrs)
    assert r.status_code == 504, r.text  # its deadline: the first run's, not a fresh one


async def test_a_cancelled_streaming_run_is_run_again_by_its_retry(fleet: Fleet) -> None:
    """A client that hung up cancelled its run: a retry of its key must not
    attach to a stream that will never end, it runs again."""
    started_before = await sim_started(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        url = f"{fleet.base_url}/v1/chat/completions"
        async with c.stream("POST", url, json=BODY, headers=headers(fleet, "cancel-me")) as r:
            first_id = r.headers["x-request-id"]
            await read_events(r, stop_after=2)  # then hang up

        async def cancelled_recorded() -> bool:
            return bool(ledger_records(fleet, first_id))

        await until(cancelled_recorded, "the cancelled run's record")
        async with c.stream("POST", url, json=BODY, headers=headers(fleet, "cancel-me")) as r2:
            second_id = r2.headers["x-request-id"]
            texts, _, done, error = await read_events(r2)
    assert error is None
    assert done
    assert second_id != first_id  # a new generation of the key
    assert await sim_started(fleet) - started_before == 2
    assert "".join(texts) == reference(fleet)


async def test_a_client_leaving_as_its_answer_is_recorded_leaves_it_recorded(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The client reads its stream's last chunk and hangs up while the gateway
    still records the run (its key's replay goes to Redis, frozen here). The
    hang-up changes nothing: the record completes, a retry of the key gets the
    first run's answer, the engine ran once. Before, the hang-up cancelled the recording
    midway and released the key: the retry ran, and was charged, again."""
    fleet = make_fleet(workers=1)
    assert fleet.redis is not None
    redis_pid = fleet.redis.proc.pid
    started_before = await sim_started(fleet)
    url = f"{fleet.base_url}/v1/chat/completions"
    # The engine holds the first token 5 s: Redis is frozen while it does (the
    # hold and the queueing are done by then), so the answer's end is always
    # recorded against a frozen Redis, however late this client reads.
    hdrs = {**headers(fleet, "leave-at-the-end", slow=False), "X-Sim-Fault": "stall:5000"}
    frozen = False

    async def freeze_once_queued() -> None:
        nonlocal frozen

        async def in_engine() -> bool:
            async with httpx.AsyncClient() as s:
                return int((await s.get(f"{fleet.sim_url}/sim/stats")).json()["records"]) >= 1

        await until(in_engine, "the request in the engine")
        os.kill(redis_pid, signal.SIGSTOP)  # the tokens need no Redis
        frozen = True

    try:
        async with httpx.AsyncClient(timeout=30) as c:
            body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
            freezing = asyncio.create_task(freeze_once_queued())
            async with c.stream("POST", url, json=body, headers=hdrs) as r:
                first_id = r.headers["x-request-id"]
                async for line in r.aiter_lines():
                    if '"usage":{' in line:
                        break  # the last chunk before [DONE]: the gateway records now
            await freezing
            assert frozen

            async def left_or_done() -> bool:
                # The gateway sees the hang-up while it records (the case
                # here), or, on a box so loaded that this client read its last
                # chunk late, its recording gave up on the frozen Redis first
                # (2 s a call) and it ended the response before noticing.
                text = (await c.get(fleet.gateway_metrics_urls[0])).text
                if metric_sum(text, "jetserve_gateway_client_left_total", when="at_end") >= 1:
                    return True
                log = (fleet.workdir / "gateway0.log").read_text()
                return "storing idempotent stream" in log

            await until(left_or_done, "the gateway seeing the client leave, or giving up")
            os.kill(redis_pid, signal.SIGCONT)
            frozen = False
            async with c.stream("POST", url, json=body, headers=hdrs) as r2:
                # The first run's answer (replayed, or followed while its record
                # is still being written), not a new generation of the key.
                assert r2.headers["x-request-id"] == first_id
                texts, _, done, error = await read_events(r2)
    finally:
        if frozen:
            os.kill(redis_pid, signal.SIGCONT)
    assert error is None
    assert done
    assert await sim_started(fleet) - started_before == 1
    async with httpx.AsyncClient() as c:
        text = (await c.get(fleet.gateway_metrics_urls[0])).text
    # Decided before its last chunks went out: never a hang-up "in flight".
    assert metric_sum(text, "jetserve_gateway_client_left_total", when="in_flight") == 0
    assert "".join(texts) == reference(fleet)  # (the reference asks the engine itself)

    async def recorded() -> bool:
        return len(ledger_records(fleet, first_id)) == 1

    await until(recorded, "the run's one ledger record")
    (row,) = ledger_records(fleet, first_id)
    assert row["outcome"] in ("stop", "length"), row  # its finish reason, not a cancel
    assert isinstance(row["charge_micros"], int)
    assert row["charge_micros"] > 0


async def test_a_retry_that_loses_its_own_link_leaves_the_run_and_its_claim(
    make_fleet: Callable[..., Fleet],
) -> None:
    """The first try runs on gateway 0, which owns the key's claim. A retry on
    gateway 1 attaches to the run, then gateway 1 loses its link to NATS: that
    retry ends ``stream_interrupted``, its own failure, not the run's. It used
    to release the claim (a third try ran the engine again, charged again) and
    cancel the run by id (the first client's stream ended too), and it settled
    the run's books with what it had relayed."""
    fleet = make_fleet(workers=1, gateway_args=["--heartbeat-timeout", "1"])
    body = {**BODY, "max_tokens": 400, "ignore_eos": True}  # 10 s of tokens
    started_before = await sim_started(fleet)
    key = "retry-loses-its-link"
    async with CutProxy(fleet.nats_nodes[0].port) as proxy:
        fleet.start_gateway("--nats", proxy.url, wait=False)
        await asyncio.to_thread(fleet.wait_gateway, 1)  # off the loop: the proxy runs on it
        url0, url1 = (f"{u}/v1/chat/completions" for u in fleet.base_urls[:2])
        async with httpx.AsyncClient(timeout=60) as c:

            async def read(url: str) -> tuple[str, str, bool, dict[str, object] | None]:
                async with c.stream("POST", url, json=body, headers=headers(fleet, key)) as r:
                    assert r.status_code == 200
                    texts, _, done, error = await read_events(r)
                    return r.headers["x-request-id"], "".join(texts), done, error

            first = asyncio.create_task(read(url0))

            async def engine_started() -> bool:
                return await sim_started(fleet) > started_before

            await until(engine_started, "the engine to start the first try")
            async with c.stream("POST", url1, json=body, headers=headers(fleet, key)) as r:
                assert r.status_code == 200
                attached_id = r.headers["x-request-id"]
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # following the run
                proxy.cut()
                rest = [line async for line in lines]
            assert any("stream_interrupted" in line for line in rest), rest
            # Its failure is not the run's: gateway 1 records no outcome and settles
            # nothing (it used to settle its partial view: 11 of 1,200 tokens were
            # the run's one record, and the owner's full settlement was refused).
            gw1 = (await c.get(fleet.gateway_metrics_urls[1])).text
            assert metric_sum(gw1, "jetserve_gateway_requests_total") == 0
            # Back on NATS: whatever gateway 1 had queued to send goes out now.
            before = proxy.accepted
            proxy.restore()

            async def back() -> bool:
                return proxy.accepted > before

            await until(back, "gateway 1 back on NATS")
            third_id, third_text, third_done, third_error = await read(url0)
            run_id, text, done, error = await first
    assert attached_id == run_id
    assert third_id == run_id  # attached to the same run, not a new one
    assert (error, third_error) == (None, None)
    assert done
    assert third_done
    assert third_text == text
    assert await sim_started(fleet) - started_before == 1  # the engine worked once
    rows = ledger_records(fleet, run_id)
    assert [r["status"] for r in rows] == [200], rows  # one record, the run's own
    usage = rows[0]["usage"]
    assert isinstance(usage, dict)
    assert usage["completion_tokens"] == 400  # all of it, not the retry's view


async def test_forgetting_a_refused_claim_leaves_a_later_claims_admitting_mark(
    redis_server: Service,
) -> None:
    """A claim refused before anything was held is forgotten: its key, its "still
    admitting" mark and its generation go. Its own mark only: once the key is
    released, a retry may claim it anew and mark itself admitting before the mark
    is deleted. Deleting that retry's mark let a third retry take over a run that
    was only slow to be queued, and run it twice."""
    rds = aioredis.Redis.from_url(redis_server.redis_url("gateway"))
    try:
        store = IdempotencyStore(rds, ttl_s=600)
        first = await store.claim("acme", "refused", b"{}", time.time() + 60)
        assert first.fresh
        await store.admitting(first, 5.0)
        alive = PREFIX + "alive:" + first.key_hash
        await rds.set(alive, "a-retrys-owner", px=5000)  # as the retry's admission does
        assert await store.forget(first)
        assert await rds.get(alive) == b"a-retrys-owner"
        # A claim's own mark goes with it, and the generation is given back.
        second = await store.claim("acme", "refused", b"{}", time.time() + 60)
        assert second.fresh
        assert second.request_id == first.request_id
        await store.admitting(second, 5.0)
        assert await store.forget(second)
        assert not await store.alive(second)
    finally:
        await rds.aclose()

"""Issue 3's guarantees through real gateway processes sharing NATS and Redis."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import httpx
import msgspec
import pytest

from gateway.config import GatewayConfig
from gateway.tenancy.pricing import Price
from jetserve.fleet import Fleet
from streams.redis_client import open_redis
from tests.waits import until

pytestmark = pytest.mark.connected

# Refusals past the record rate are summarised every 10 s, on a 5 s tick: soon,
# for tests that count every refusal's record.
SUMMARIES_SOON = ["--refusal-summary-every", "0.5", "--outbox-scan", "0.5"]
BODY = {"model": "sim-8b", "max_tokens": 8, "messages": [{"role": "user", "content": "budget me"}]}


def ledger(fleet: Fleet, tenant: str) -> list[dict[str, object]]:
    with fleet.admin() as admin:
        text = admin.ledger(tenant)
    return [msgspec.json.decode(line) for line in text.splitlines() if line]


def counted(records: list[dict[str, object]], policy: str | None = None) -> int:
    """The requests ``records`` stand for (a summary of refusals counts many)."""
    return sum(int(r["count"]) for r in records if policy in (None, r["policy"]))  # type: ignore[call-overload]


async def until_records(fleet: Fleet, n: int) -> list[dict[str, object]]:
    """The tenant's ledger once it counts ``n`` requests (every outcome is recorded)."""
    found: list[dict[str, object]] = []

    async def complete() -> bool:
        found[:] = await asyncio.to_thread(ledger, fleet, fleet.spec.tenant)
        return counted(found) >= n

    await until(complete, f"{n} ledger records")
    return found


async def sim_started(fleet: Fleet) -> int:
    async with httpx.AsyncClient() as c:
        return int((await c.get(f"{fleet.sim_url}/sim/stats")).json()["started"])


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_budget_holds_for_1000_concurrent_requests_through_3_gateways(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Output tokens only are priced, and the simulator generates exactly max_tokens
    # here: every request costs exactly its worst case, so the budget admits 100.
    fleet = make_fleet(
        gateways=3, workers=2, gateway_args=["--price", "sim-8b=0/1000", *SUMMARIES_SOON]
    )
    cost = Price(0, 1000).worst_case(0, int(BODY["max_tokens"]))  # type: ignore[call-overload]
    with fleet.admin() as admin:
        admin.set_limits("tenant", fleet.spec.tenant, budget_micros=100 * cost, period="total")
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    # 100 clients x 10 connections: 1000 requests really in flight at once (one
    # httpx pool with 1000 connections would serialise them client-side).
    clients = [
        httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=10)) for _ in range(100)
    ]
    try:
        rs = await asyncio.gather(
            *(
                clients[i % 100].post(
                    f"{fleet.base_urls[i % 3]}/v1/chat/completions", json=BODY, headers=headers
                )
                for i in range(1000)
            )
        )
    finally:
        for client in clients:
            await client.aclose()
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code == 429]
    assert len(ok) + len(refused) == 1000, {r.status_code for r in rs}
    assert len(ok) == 100  # at most 100 by the budget; and no hold leaked
    assert all(r.json()["error"]["code"] == "budget_exceeded" for r in refused)
    assert all(r.json()["error"]["type"] == "insufficient_quota" for r in refused)
    # The books may lag the answers: a settlement the stores were too slow for
    # waits in the outbox (--outbox-grace) and is applied by a scan, and a refusal's
    # record is appended after its answer. Wait for both kinds, then count them.
    records: list[dict[str, object]] = []

    async def settled() -> bool:
        nonlocal records
        records = await asyncio.to_thread(ledger, fleet, fleet.spec.tenant)
        admitted = sum(1 for r in records if r["policy"] == "admitted")
        return admitted >= len(ok) and counted(records, "rejected:budget") >= len(refused)

    await until(settled, "every request's record", 90.0, every_s=0.5)
    with fleet.admin() as admin:
        limits_now = admin.get_limits("tenant", fleet.spec.tenant)
    admitted = [r for r in records if r["policy"] == "admitted"]
    assert len(admitted) == len(ok)
    # Refusals past the per-tenant record rate are counted in summaries: each once.
    assert counted(records, "rejected:budget") == len(refused)
    charges = sum(int(r["charge_micros"]) for r in records)  # type: ignore[call-overload]
    assert limits_now["reserved_micros"] == 0
    assert limits_now["spent_micros"] == charges <= 100 * cost
    print(f"\nbudget race: admitted {len(ok)}/1000, spent {charges} of {100 * cost} micro-USD")


def causes(exc: BaseException) -> str:
    """``exc`` and the exceptions under it, outermost first."""
    chain: list[str] = []
    at: BaseException | None = exc
    while at is not None and len(chain) < 8:
        chain.append(repr(at))
        at = at.__cause__ or at.__context__
    return " <- ".join(chain)


def gcra_admits(arrivals: list[float], rpm: int, burst_s: float) -> int:
    """How many of ``arrivals`` (seconds, any order) GCRA admits at ``rpm`` with a
    ``burst_s`` tolerance: the rule of gateway/tenancy/accounting_lua.py, run here
    in the script's whole microseconds."""
    interval, burst = 60_000_000 / rpm, int(burst_s * 1_000_000)
    tat, admitted = None, 0
    for now in sorted(int(t * 1_000_000) for t in arrivals):
        new_tat = max(now if tat is None else tat, now) + interval
        if new_tat - now <= max(burst, interval):
            tat, admitted = new_tat, admitted + 1
    return admitted


async def test_rate_limit_holds_within_5_percent_across_3_gateways(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Every refusal gets its own record (no summaries): its arrival time counts below.
    fleet = make_fleet(
        gateways=3, workers=2, gateway_args=[*SUMMARIES_SOON, "--refusal-records-burst", "10000"]
    )
    rpm, burst_s = 1200, 6.0  # 20/s; GCRA burst: 6 s worth (gateway/tenancy/accounting.py)
    with fleet.admin() as admin:
        admin.set_limits("tenant", fleet.spec.tenant, rpm=rpm)
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    duration, offered_per_s = 8.0, 80
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as c:
        start = time.monotonic()

        async def one(i: int) -> tuple[int, float]:
            await asyncio.sleep(i / offered_per_s)  # open loop: a fixed schedule
            sent = time.monotonic() - start
            try:
                r = await c.post(
                    f"{fleet.base_urls[i % 3]}/v1/chat/completions", json=BODY, headers=headers
                )
            except httpx.TransportError as exc:
                # Seen rarely on a loaded box (a ReadError awaiting the headers),
                # cause unknown: the summary line keeps which socket error it was.
                raise AssertionError(
                    f"request {i} to gateway {i % 3} (sent at {sent:.2f} s, failed at "
                    f"{time.monotonic() - start:.2f} s): {causes(exc)}"
                ) from exc
            return r.status_code, sent

        # A task group, not gather: one request's failure cancels the rest, so
        # none is left running on a closed client (its sockets then failed the
        # next test on this worker as "unclosed transport").
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(i)) for i in range(int(duration * offered_per_s))]
        results = [t.result() for t in tasks]
    admitted = sum(1 for s, _ in results if s == 200)
    limited = sum(1 for s, _ in results if s == 429)
    assert admitted + limited == len(results)
    # The limiter is judged against the load it saw, by the gateways' clock (each
    # record's created: the request built, just before its hold), not the client's
    # schedule: on a loaded box the gateways fall behind it and bunch requests up,
    # and time in which fewer than 20/s arrive leaves capacity unused (a window's
    # count then falls below rate x (window + burst) without any limiter error).
    records = await until_records(fleet, len(results))
    assert all(int(r["count"]) == 1 for r in records)  # type: ignore[call-overload]
    assert counted(records, "rejected:rate") == limited  # every 429 the limiter's
    created = [float(r["created"]) for r in records]  # type: ignore[arg-type]
    window = max(created) - min(created)
    bound = rpm / 60 * (window + burst_s)  # GCRA's ceiling: rate x (window + burst)
    expected = gcra_admits(created, rpm, burst_s)
    error = abs(admitted - expected) / expected
    sent = [t for _, t in results]
    print(
        f"\nrate limit: admitted {admitted}, GCRA over the same arrivals {expected} "
        f"(ceiling {bound:.0f} over the holds' {window:.2f} s; sent over "
        f"{max(sent) - min(sent):.2f} s), error {error:.1%}; "
        f"records {Counter(str(r['policy']) for r in records)}"
    )
    assert admitted <= bound + 1  # never more than the rate allows, whatever the timing
    assert error < 0.05


async def test_redis_down_fails_closed_and_recovers(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(gateways=2, workers=1)
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        for url in fleet.base_urls:
            assert (
                await c.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)
            ).status_code == 200
        before = await sim_started(fleet)
        assert fleet.redis is not None
        fleet.redis.stop()
        statuses = [
            (await c.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)).status_code
            for url in fleet.base_urls
            for _ in range(5)
        ]
        assert statuses == [503] * 10
        ready = await c.get(f"{fleet.base_url}/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["redis"] is False
        assert await sim_started(fleet) == before  # nothing was dispatched
        await asyncio.to_thread(fleet.redis.restart)
        for url in fleet.base_urls:
            r = await c.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)
            assert r.status_code == 200, r.text


async def test_tenants_cannot_see_each_others_ledger(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        admin.create_tenant("acme")
        admin.create_tenant("globex")
        key_a = admin.create_key("acme")["api_key"]
        key_b = admin.create_key("globex")["api_key"]
    async with httpx.AsyncClient(timeout=30) as c:
        for key in (key_a, key_b):
            r = await c.post(
                f"{fleet.base_url}/v1/chat/completions",
                json=BODY,
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200
        mine = await c.get(
            f"{fleet.base_url}/v1/ledger", headers={"Authorization": f"Bearer {key_a}"}
        )
        other = await c.get(
            f"{fleet.base_url}/v1/ledger?tenant=globex",
            headers={"Authorization": f"Bearer {key_a}"},
        )
        admin_view = await c.get(
            f"{fleet.admin_url}/admin/ledger?tenant=globex",
            headers={"Authorization": f"Bearer {key_a}"},  # a tenant key is no admin credential
        )
    records = [msgspec.json.decode(x) for x in mine.text.splitlines()]
    assert records
    assert {r["tenant"] for r in records} == {"acme"}
    assert other.status_code == 400
    assert admin_view.status_code == 401
    assert "budget me" not in mine.text  # no prompt text in the ledger


async def test_idempotency_key_sequential_and_concurrent(fleet: Fleet) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        for label in ("seq", "conc"):
            headers = {"Authorization": f"Bearer {fleet.api_key}", "Idempotency-Key": f"k-{label}"}
            url = f"{fleet.base_url}/v1/chat/completions"
            before = await sim_started(fleet)
            if label == "seq":
                rs = [await c.post(url, json=BODY, headers=headers) for _ in range(2)]
            else:
                rs = list(
                    await asyncio.gather(
                        *(c.post(url, json=BODY, headers=headers) for _ in range(5))
                    )
                )
            assert {r.status_code for r in rs} == {200}
            assert len({r.content for r in rs}) == 1  # identical responses, ids included
            assert await sim_started(fleet) - before == 1  # one engine call
        other_body = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={**BODY, "max_tokens": 9},
            headers={"Authorization": f"Bearer {fleet.api_key}", "Idempotency-Key": "k-seq"},
        )
        assert other_body.status_code == 400
        assert other_body.json()["error"]["code"] == "idempotency_key_reused"
    charged = [r for r in ledger(fleet, fleet.spec.tenant) if r["idempotency_key_hash"]]
    assert len(charged) == 2  # one charge per key


async def test_an_idempotent_retry_renders_created_as_the_request_was_accepted(
    fleet: Fleet,
) -> None:
    """Two renderings of one run, the first's and an attached retry's, each made
    when the final frame arrives: ``created`` must be the request's acceptance,
    or the two differ whenever a second ticks between them (a flake of the test
    above). The run here lasts over 2 s, so the render time cannot pass for it."""
    headers = {
        "Authorization": f"Bearer {fleet.api_key}",
        "Idempotency-Key": "k-created",
        "X-Sim-Fault": "slow:300",  # 8 tokens, 300 ms apart
    }
    url = f"{fleet.base_url}/v1/chat/completions"
    sent = time.time()
    async with httpx.AsyncClient(timeout=30) as c:
        rs = await asyncio.gather(*(c.post(url, json=BODY, headers=headers) for _ in range(2)))
    assert time.time() - sent >= 2.0
    assert [r.status_code for r in rs] == [200, 200]
    assert rs[0].content == rs[1].content
    assert rs[0].json()["created"] - int(sent) in (0, 1)  # the second may tick at acceptance


async def test_revoked_key_dies_on_every_replica_within_1s(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(gateways=3, workers=1)
    with fleet.admin() as admin:
        created = admin.create_key(fleet.spec.tenant, "to-revoke")
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    async with httpx.AsyncClient(timeout=30) as c:
        models = [f"{u}/v1/models" for u in fleet.base_urls]
        assert [(await c.get(u, headers=headers)).status_code for u in models] == [200] * 3
        with fleet.admin() as admin:
            admin.revoke_key(created["key"]["key_id"])
        revoked_at = time.monotonic()  # the revoked record is stored
        # A replica answers from its key cache only while the entry is younger than
        # key_cache_s, timed from before the read that filled it: a request sent that
        # long after the revocation was stored meets it on every replica, however
        # loaded the machine (a wall-clock bound on the whole loop measured the box:
        # 1.30 s once in CI). Waiting out the cache is the guarantee under test.
        await asyncio.sleep(max(0.0, revoked_at + GatewayConfig.key_cache_s - time.monotonic()))
        assert [(await c.get(u, headers=headers)).status_code for u in models] == [401] * 3


async def test_key_scopes_limit_models_and_classes(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        key = admin.create_key(
            fleet.spec.tenant, "batch-only", scopes={"models": ["sim-8b"], "classes": ["batch"]}
        )["api_key"]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        url = f"{fleet.base_url}/v1/chat/completions"
        denied = await c.post(url, json=BODY, headers=headers)  # interactive by default
        allowed = await c.post(url, json=BODY, headers={**headers, "X-Jetserve-Class": "batch"})
        embed = await c.post(
            f"{fleet.base_url}/v1/embeddings",
            json={"model": "sim-embed", "input": "x"},
            headers=headers,
        )
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "permission_denied"
    assert allowed.status_code == 200
    assert embed.status_code == 403


async def test_idempotency_key_retry_after_a_retryable_failure_runs_again(fleet: Fleet) -> None:
    headers = {"Authorization": f"Bearer {fleet.api_key}", "Idempotency-Key": "k-retry"}
    url = f"{fleet.base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as c:
        failed = await c.post(url, json=BODY, headers={**headers, "X-Sim-Fault": "503"})
        assert failed.status_code == 503  # the engine refused every redelivery
        retried = await c.post(url, json=BODY, headers=headers)
        again = await c.post(url, json=BODY, headers=headers)
    assert retried.status_code == 200, retried.text
    assert again.content == retried.content
    assert again.headers["idempotent-replayed"] == "true"


async def test_tool_and_data_class_scopes(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        key = admin.create_key(
            fleet.spec.tenant, "scoped", scopes={"tools": ["search"], "data_classes": ["public"]}
        )["api_key"]
    tool = {"type": "function", "function": {"name": "transfer", "parameters": {}}}
    url = f"{fleet.base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as c:
        h = {"Authorization": f"Bearer {key}", "X-Jetserve-Data-Class": "public"}
        bad_tool = await c.post(url, json={**BODY, "tools": [tool]}, headers=h)
        bad_class = await c.post(url, json=BODY, headers={**h, "X-Jetserve-Data-Class": "pii"})
        ok = await c.post(url, json=BODY, headers=h)
    assert bad_tool.status_code == 403
    assert "transfer" in bad_tool.json()["error"]["message"]
    assert bad_class.status_code == 403
    assert ok.status_code == 200


async def test_output_is_bounded_when_the_client_sets_no_max_tokens(fleet: Fleet) -> None:
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": "unbounded?"}]}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={**body, "ignore_eos": True},  # the engine would go on to its context limit
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 512  # the gateway's default hold


async def test_refusals_past_the_record_rate_are_counted_in_a_summary(
    make_fleet: Callable[..., Fleet],
) -> None:
    # A refusal costs its sender nothing, and its record cost three stored writes
    # and half a KiB kept 90 days: 4,000 requests into a rate limit made 3,999
    # records. Past a per-tenant burst they are counted into summary records.
    fleet = make_fleet(
        gateways=1,
        workers=1,
        gateway_args=[
            "--refusal-records-burst", "3", "--refusal-records-per-s", "0",
            "--refusal-summary-every", "0.2", "--outbox-scan", "0.2",
        ],
    )  # fmt: skip
    with fleet.admin() as admin:
        admin.set_limits("tenant", fleet.spec.tenant, budget_micros=0, period="total")
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30, base_url=fleet.base_url) as c:
        rs = await asyncio.gather(
            *(c.post("/v1/chat/completions", json=BODY, headers=headers) for _ in range(40))
        )
    assert [r.status_code for r in rs] == [429] * 40
    assert {r.json()["error"]["code"] for r in rs} == {"budget_exceeded"}
    records = await until_records(fleet, 40)
    assert counted(records) == 40  # each refusal once: a record or a count
    assert {r["policy"] for r in records} == {"rejected:budget"}
    singles = [r for r in records if r["count"] == 1]
    summaries = [r for r in records if r["count"] != 1]
    assert len(singles) == 3  # the burst, one record each
    assert summaries
    assert all(str(r["request_id"]).startswith("refusals_") for r in summaries)
    assert {(r["key_id"], r["model"], r["status"]) for r in summaries} == {
        (singles[0]["key_id"], "sim-8b", 429)
    }


async def test_refused_requests_leave_no_idempotency_keys_and_a_retry_is_judged_anew(
    make_fleet: Callable[..., Fleet],
) -> None:
    # The Idempotency-Key is claimed before the hold: a request the accountant
    # refused left its generation for a day and (a spent budget) its refusal for
    # the window, replayed even after the budget was raised. A tenant refused for
    # free, one new key per request, filled the Redis everyone's books are in.
    fleet = make_fleet(workers=1)
    with fleet.admin() as admin:
        admin.set_limits("tenant", fleet.spec.tenant, budget_micros=0, period="total")
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30, base_url=fleet.base_url) as c:
        for i in range(20):
            r = await c.post(
                "/v1/chat/completions", json=BODY, headers={**headers, "Idempotency-Key": f"k{i}"}
            )
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "budget_exceeded"
        redis = open_redis(fleet.redis_url)
        try:
            left = [k async for k in redis.scan_iter(match="jetserve:idem:*")]
        finally:
            await redis.aclose()
        assert left == []
        with fleet.admin() as admin:
            admin.set_limits("tenant", fleet.spec.tenant, budget_micros=10**9, period="total")
        again = await c.post(
            "/v1/chat/completions", json=BODY, headers={**headers, "Idempotency-Key": "k3"}
        )
        assert again.status_code == 200, again.text  # judged anew, not the refusal replayed
        replay = await c.post(
            "/v1/chat/completions", json=BODY, headers={**headers, "Idempotency-Key": "k3"}
        )
        assert replay.headers.get("Idempotent-Replayed") == "true"
        assert replay.json() == again.json()
    # The retry's record is there under its id (the key's: that of its refused first
    # try, whose record took one of its own, else the retry's was a duplicate).
    rid = again.headers["X-Request-Id"]

    async def recorded() -> bool:
        rows = await asyncio.to_thread(ledger, fleet, fleet.spec.tenant)
        return any(r["request_id"] == rid and r["policy"] == "admitted" for r in rows)

    await until(recorded, "the retry's record")
    rows = await asyncio.to_thread(ledger, fleet, fleet.spec.tenant)
    assert counted(rows, "rejected:budget") == 20


async def test_admitted_and_refused_records_name_the_same_org(fleet: Fleet) -> None:
    # Regression: refused records carried org="" while run records carried the
    # tenant; one record builder (gateway/tenancy/records.py) fills it for all.
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30, base_url=fleet.base_url) as c:
        ok = await c.post("/v1/chat/completions", json=BODY, headers=headers)
        assert ok.status_code == 200
        with fleet.admin() as admin:
            admin.set_limits("tenant", fleet.spec.tenant, budget_micros=0, period="total")
        refused = await c.post("/v1/chat/completions", json=BODY, headers=headers)
        assert refused.status_code == 429
    records = ledger(fleet, fleet.spec.tenant)
    policies = {str(r["policy"]) for r in records}
    assert {"admitted", "rejected:budget"} <= policies
    orgs = {str(r["org"]) for r in records}
    assert len(orgs) == 1
    assert "" not in orgs

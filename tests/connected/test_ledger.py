"""The request ledger against a real nats-server: provisioning, dedupe, tenant
isolation, time ranges, bounded reads and export."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from gateway.tenancy.request_ledger import READ_BATCH, LedgerReader, LedgerWriteError, LedgerWriter
from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from streams.request_ledger import (
    DEFAULT_LEDGER,
    InvalidTenantError,
    LedgerRecord,
    LedgerTopology,
    decode_record,
    ensure_ledger,
)
from streams.wire import Usage

pytestmark = pytest.mark.connected

STREAM = DEFAULT_LEDGER.stream


def record(tenant: str, i: int, created: float | None = None, **kw: Any) -> LedgerRecord:
    fields: dict[str, Any] = dict(
        request_id=f"{tenant}-req-{i}",
        tenant=tenant,
        org="org-1",
        key_id="key_1",
        op="chat",
        cls="interactive",
        model="m",
        route="chat-default",
        route_revision=3,
        deployment="fp-abc",
        attempts=1,
        policy="admitted",
        usage=Usage(prompt_tokens=10 + i, cached_tokens=2, completion_tokens=5),
        price_version="p1",
        charge_micros=100 + i,
        reserved_micros=500,
        outcome="stop",
        status=200,
        created=time.time() if created is None else created,
        first_token_ms=12.5,
        duration_ms=80.0,
        gateway="gw1",
    )
    fields.update(kw)
    return LedgerRecord(**fields)


@dataclass
class Bus:
    nc: Client
    js: JetStreamContext
    url: str


@pytest.fixture
async def bus(nats_server: Service) -> AsyncIterator[Bus]:
    url = f"nats://127.0.0.1:{nats_server.port}"
    nc = await connect(url, "ledger-test", nats_server.bus_auth(Role.GATEWAY))
    try:
        js = nc.jetstream()
        await ensure_ledger(js)
        yield Bus(nc, js, url)
    finally:
        await nc.close()


async def collect(reader: LedgerReader, tenant: str, **kw: Any) -> list[LedgerRecord]:
    return [r async for r in reader.query(tenant, **kw)]


async def consumers(js: JetStreamContext) -> int:
    return (await js.stream_info(STREAM)).state.consumer_count


async def test_provisioning_is_idempotent_and_concurrent(
    nats_server: Service, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"nats://127.0.0.1:{nats_server.port}"
    conns = [await connect(url, f"p{i}", nats_server.bus_auth(Role.GATEWAY)) for i in range(4)]
    admin = await connect(url, "admin", nats_server.bus_auth(Role.ADMIN))
    try:
        # Gateways create it (concurrently), and never change it (streams/auth.py).
        await asyncio.gather(*(ensure_ledger(nc.jetstream(), update=False) for nc in conns))
        js = conns[0].jetstream()
        await ensure_ledger(js, update=False)
        cfg = (await js.stream_info(STREAM)).config
        assert cfg.subjects == ["jetserve.ledger.*"]
        assert cfg.retention == "limits"
        assert cfg.storage == "file"
        assert cfg.max_age == 90 * 86_400
        assert cfg.duplicate_window == 600
        assert cfg.deny_delete
        short = LedgerTopology(max_age_s=7 * 86_400)
        with caplog.at_level(logging.WARNING, logger="streams.provision"):
            await ensure_ledger(js, short, update=False)  # a gateway's: left as it is
        assert (await js.stream_info(STREAM)).config.max_age == 90 * 86_400
        assert any("differs" in r.message and "max_age" in r.message for r in caplog.records)
        # The operator's credential applies a changed limit in place, concurrently too.
        admins = [admin.jetstream(), admin.jetstream()]
        await asyncio.gather(*(ensure_ledger(a, short) for a in admins))
        assert (await js.stream_info(STREAM)).config.max_age == 7 * 86_400
    finally:
        for nc in (*conns, admin):
            await nc.close()


async def test_append_and_query_round_trip(bus: Bus) -> None:
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    written = [
        record("acme", 0),
        record("acme", 1, first_token_ms=None, outcome="cancelled", policy="rejected:budget"),
        record("acme", 2, op="embedding", usage=Usage(prompt_tokens=7)),
    ]
    for r in written:
        await writer.append(r)
    assert await collect(reader, "acme") == written
    assert await collect(reader, "acme", limit=2) == written[:2]
    assert await reader.sum_charges("acme") == 100 + 101 + 102
    # Every query deletes its consumer when done, early stop (limit) included.
    assert await consumers(bus.js) == 0


class LosesFirstAck:
    """A JetStream context whose first publish reaches the stream but whose ack is
    lost: exactly the case where a writer retry could duplicate a record."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self.calls = 0

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        ack = await self._js.publish(*args, **kwargs)
        if self.calls == 1:
            raise nats.errors.TimeoutError
        return ack


async def test_retried_append_is_stored_once(bus: Bus) -> None:
    flaky = LosesFirstAck(bus.js)
    writer = LedgerWriter(flaky, backoff_s=0.01)  # type: ignore[arg-type]
    r = record("acme", 0)
    await writer.append(r)
    assert flaky.calls == 2
    await LedgerWriter(bus.js).append(r)  # a restarted gateway appending it again
    assert (await bus.js.stream_info(STREAM)).state.messages == 1
    assert await collect(LedgerReader(bus.js), "acme") == [r]
    # The same request id under another tenant is another record.
    await LedgerWriter(bus.js).append(record("other", 0, request_id=r.request_id))
    assert (await bus.js.stream_info(STREAM)).state.messages == 2


class AlwaysTimesOut:
    calls = 0

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise nats.errors.TimeoutError


async def test_append_gives_up_with_a_clear_error(bus: Bus) -> None:
    dead = AlwaysTimesOut()
    writer = LedgerWriter(dead, attempts=3, backoff_s=0.01)  # type: ignore[arg-type]
    with pytest.raises(LedgerWriteError, match="after 3 attempts") as info:
        await writer.append(record("acme", 0))
    assert dead.calls == 3
    assert info.value.code == "ledger_write_failed"
    # A refusal by the server is not retried: an oversized record (text smuggled in).
    with pytest.raises(LedgerWriteError, match="refused"):
        await LedgerWriter(bus.js).append(record("acme", 1, model="x" * 100_000))


async def test_tenants_never_see_each_other(bus: Bus) -> None:
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    # "acme-eu" shares a prefix with "acme": subjects are whole tokens, no leak.
    tenants = ["acme", "acme-eu", "globex"]
    for i in range(30):
        await writer.append(record(tenants[i % 3], i))
    for t in tenants:
        got = await collect(reader, t)
        assert len(got) == 10
        assert {r.tenant for r in got} == {t}
        assert [r.request_id for r in got] == [
            f"{t}-req-{i}" for i in range(30) if i % 3 == tenants.index(t)
        ]


async def test_range_filters_on_created(bus: Bus) -> None:
    # Records carry controlled `created` values (all in the past, appended now):
    # the range is decided by `created`, not by when the server stored them.
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    base = time.time() - 1000
    for i in range(10):
        await writer.append(record("acme", i, created=base + i))
    got = await collect(reader, "acme", since=base + 3, until=base + 6)
    assert [r.created for r in got] == [base + 3, base + 4, base + 5, base + 6]
    assert len(await collect(reader, "acme", since=base + 9.5)) == 0
    assert len(await collect(reader, "acme", until=base + 0.5)) == 1
    assert await reader.sum_charges("acme", base + 3, base + 6) == 103 + 104 + 105 + 106


async def test_since_starts_the_scan_by_server_time(bus: Bus) -> None:
    # The server-side start position (by_start_time, the server's receive time) is
    # a scan bound, widened by clock_skew_s. With no skew allowed, batch 1 (stored
    # before `since`) is never read, even though its `created` (set in the future
    # on purpose) would pass the `created` filter: only the start position skips it.
    writer = LedgerWriter(bus.js)
    for i in range(5):
        await writer.append(record("acme", i, created=time.time() + 3600))
    await asyncio.sleep(0.1)
    since = time.time()
    await asyncio.sleep(0.1)
    batch2 = [record("acme", 5 + i) for i in range(5)]
    for r in batch2:
        await writer.append(r)
    strict = LedgerReader(bus.js, LedgerTopology(clock_skew_s=0))
    assert await collect(strict, "acme", since=since) == batch2
    # With the default 5 s of skew allowance the scan starts earlier and the
    # `created` filter decides: batch 1's future `created` passes it.
    assert len(await collect(LedgerReader(bus.js), "acme", since=since)) == 10


async def test_until_stops_the_scan_by_server_time(bus: Bus) -> None:
    # The scan stops at records stored later than until + max_append_delay + skew.
    # A record appended later than that (here: both bounds 0, and a `created`
    # backdated on purpose) is beyond the scan: documented in LedgerTopology.
    writer = LedgerWriter(bus.js)
    batch1 = [record("acme", i) for i in range(3)]
    for r in batch1:
        await writer.append(r)
    await asyncio.sleep(0.1)
    until = time.time()
    await asyncio.sleep(0.1)
    for i in range(3):
        await writer.append(record("acme", 3 + i, created=until - 1))
    tight = LedgerReader(bus.js, LedgerTopology(clock_skew_s=0, max_append_delay_s=0))
    assert await collect(tight, "acme", until=until) == batch1
    assert len(await collect(LedgerReader(bus.js), "acme", until=until)) == 6


async def test_empty_queries_return_promptly(bus: Bus) -> None:
    reader = LedgerReader(bus.js)
    start = time.monotonic()
    assert await collect(reader, "nobody") == []
    await LedgerWriter(bus.js).append(record("acme", 0))
    assert await collect(reader, "nobody") == []
    assert await collect(reader, "acme", since=time.time() + 60) == []  # nothing stored yet
    assert await collect(reader, "acme", limit=0) == []
    assert await reader.sum_charges("nobody") == 0
    assert time.monotonic() - start < 1.0
    assert await consumers(bus.js) == 0


async def test_query_ends_at_the_end_as_of_its_start(bus: Bus) -> None:
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    for i in range(5):
        await writer.append(record("acme", i))
    seen: list[LedgerRecord] = []
    async with contextlib.aclosing(reader.query("acme")) as it:
        async for r in it:
            seen.append(r)
            # Records appended while the query runs are not waited for.
            await writer.append(record("acme", 100 + len(seen)))
    assert len(seen) == 5
    assert [r.request_id for r in seen[:5]] == [f"acme-req-{i}" for i in range(5)]


async def test_records_vanishing_mid_read_end_the_query(bus: Bus, nats_server: Service) -> None:
    # Counted at the start, gone before read (max_age expiry, a tenant purge):
    # the reader notices and ends instead of waiting for them. A purge is the
    # operator's (the gateway's credential may not purge a stream).
    operator = await connect(bus.url, "operator", nats_server.bus_auth(Role.ADMIN))
    writer = LedgerWriter(bus.js)
    for i in range(300):
        await writer.append(record("acme", i))
    reader = LedgerReader(bus.js, fetch_timeout_s=0.3)
    seen: list[LedgerRecord] = []
    # Waiting for the vanished records would be for ever: a bound turns that into
    # a failure (not a timing: a loaded box is slow, not wrong).
    async with asyncio.timeout(30), contextlib.aclosing(reader.query("acme")) as it:
        async for r in it:
            if not seen:
                await operator.jetstream().purge_stream(STREAM, subject="jetserve.ledger.acme")
            seen.append(r)
    await operator.close()
    assert len(seen) == READ_BATCH  # the first fetched batch; the rest was purged
    assert await consumers(bus.js) == 0


async def test_a_thousand_records_read_back_fast(bus: Bus) -> None:
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    base = time.time() - 100
    gate = asyncio.Semaphore(64)

    async def put(i: int) -> None:
        async with gate:
            await writer.append(record("acme", i, created=base + i / 100))

    t0 = time.perf_counter()
    await asyncio.gather(*(put(i) for i in range(1000)))
    t1 = time.perf_counter()
    got = await collect(reader, "acme")
    t2 = time.perf_counter()
    total = await reader.sum_charges("acme", base, base + 5)  # i < 500 (+ float edge)
    t3 = time.perf_counter()
    assert len(got) == 1000
    assert len({r.request_id for r in got}) == 1000
    assert total == sum(100 + i for i in range(1000) if base + i / 100 <= base + 5)
    print(f"\nledger: append 1000 {t1 - t0:.3f}s, query 1000 {t2 - t1:.3f}s, sum {t3 - t2:.3f}s")
    assert t2 - t1 < 2.0


async def test_export_jsonl_parses_back(bus: Bus) -> None:
    writer, reader = LedgerWriter(bus.js), LedgerReader(bus.js)
    written = [record("acme", i, first_token_ms=None if i == 1 else 3.0) for i in range(4)]
    for r in written:
        await writer.append(r)
    await writer.append(record("globex", 9))
    raw = io.BytesIO()
    assert await reader.export_jsonl("acme", None, None, raw) == 4
    text = io.StringIO()
    assert await reader.export_jsonl("acme", None, None, text) == 4
    assert raw.getvalue().decode() == text.getvalue()
    lines = text.getvalue().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["request_id"] for row in rows] == [r.request_id for r in written]
    assert rows[1]["first_token_ms"] is None
    assert rows[0]["route"] == "chat-default"
    assert rows[0]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 2}
    assert [decode_record(line.encode()) for line in lines] == written
    assert not any("prompt" in k and k != "usage" for row in rows for k in row)


@pytest.mark.parametrize("tenant", ["a.b", "*", ">", "", "a b", "acme.>", "a\n", "ü"])
async def test_invalid_tenants_are_rejected(bus: Bus, tenant: str) -> None:
    reader, writer = LedgerReader(bus.js), LedgerWriter(bus.js)
    with pytest.raises(InvalidTenantError):
        reader.query(tenant)
    with pytest.raises(InvalidTenantError):
        await reader.sum_charges(tenant)
    with pytest.raises(InvalidTenantError):
        await writer.append(record(tenant, 0))
    with pytest.raises(InvalidTenantError):
        DEFAULT_LEDGER.subject(tenant)
    assert (await bus.js.stream_info(STREAM)).state.messages == 0


def test_record_has_no_text_fields_and_decodes_old_records() -> None:
    names = set(LedgerRecord.__struct_fields__)
    assert not names & {"prompt", "messages", "input", "completion", "text", "content", "body"}
    # A record written before the optional fields existed still decodes.
    full = msgspec.json.decode(msgspec.json.encode(record("acme", 0)))
    for optional in ("route", "route_revision", "deployment", "idempotency_key_hash"):
        del full[optional]
    old = decode_record(msgspec.json.encode(full))
    assert old.route == ""
    assert old.route_revision == 0

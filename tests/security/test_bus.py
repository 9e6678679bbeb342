"""The hostile-client suite, bus side: with each role's own credential, every
step that role must not take is refused by nats-server or redis-server (not by
our code), and nothing reaches a worker, a stream or a bucket.

The fleet runs exactly the generated configuration (jetserve/credentials.py):
tenant ``demo`` (the fleet's) and ``acme`` each have a service credential.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import pytest
import redis
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NoKeysError
from nats.js.kv import KeyValue

from jetserve.fleet import Fleet, FleetSpec
from streams.agent_topology import DEFAULT_AGENT
from streams.auth import EFFECTS_BUCKET, MEMBERS_BUCKET, Role, inbox_prefix
from streams.definitions import DEFAULT_TOPOLOGY
from streams.marks import CANCELS_BUCKET, FAILURES_BUCKET
from streams.request_ledger import DEFAULT_LEDGER
from streams.routes import ROUTES_BUCKET
from streams.subjects import INGRESS_CHAT, KV_INDEX_SUBJECT, RequestClass, request_subject
from tests.waits import until_sync

pytestmark = [pytest.mark.connected, pytest.mark.bus_refusals]

TOPO = DEFAULT_TOPOLOGY
BODY = {"model": "sim-8b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
WITHIN_S = 15.0  # a bound on waiting for the server's answer, never a pass condition


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with Fleet(FleetSpec(workers=1, service_tenants=("acme",))) as f:
        yield f


Connector = Callable[[Role, "str | None"], Awaitable["Probe"]]


@dataclass
class Probe:
    """A connection as one role that records what the server refused."""

    nc: Client
    errors: list[str] = field(default_factory=list)

    async def refused(self, what: str, subject: str) -> bool:
        """Until the server reports a permissions violation for ``subject``."""
        needle = f'{what} to "{subject}"'.lower()
        loop = asyncio.get_running_loop()
        end = loop.time() + WITHIN_S
        while loop.time() < end:
            if any("permissions violation" in e and needle in e for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False


@pytest.fixture
async def as_role(fleet: Fleet) -> AsyncIterator[Connector]:
    opened: list[Client] = []

    async def connect(role: Role, tenant: str | None = None) -> Probe:
        assert fleet.creds is not None
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        nc = await nats.connect(
            fleet.nats_url,
            name=f"hostile-{role.value}",
            nkeys_seed_str=fleet.creds.seed(role, tenant),
            inbox_prefix=inbox_prefix(role, tenant),
            error_cb=on_error,
            allow_reconnect=False,
        )
        opened.append(nc)
        return Probe(nc, errors)

    yield connect
    for nc in opened:
        await nc.close()


async def _messages(fleet: Fleet, stream: str) -> int:
    nc = await fleet.connect(Role.ADMIN)
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    finally:
        await nc.close()


# (role, publish or subscribe, subject): each must be refused by nats-server.
WORKER_BUCKETS = (CANCELS_BUCKET, FAILURES_BUCKET, MEMBERS_BUCKET)
AGENT_STREAMS = (
    DEFAULT_AGENT.stream, DEFAULT_AGENT.events_stream, f"KV_{DEFAULT_AGENT.bucket}",
    f"KV_{EFFECTS_BUCKET}", f"KV_{CANCELS_BUCKET}",
)  # fmt: skip
FORBIDDEN = [
    # A service: straight onto the work queue (skipping keys, budgets, limits),
    # into every tenant's replies, another tenant's inbox, the JetStream API.
    (Role.SERVICE, "publish", request_subject(RequestClass.INTERACTIVE)),
    (Role.SERVICE, "publish", f"{request_subject(RequestClass.BATCH)}.l03"),
    (Role.SERVICE, "subscription", "jetserve.reply.>"),
    (Role.SERVICE, "subscription", "jetserve.reply.acme.*.*"),
    (Role.SERVICE, "subscription", "jetserve.live.>"),  # the frames' live twins
    (Role.SERVICE, "subscription", "jetserve.live.acme.*.*"),
    (Role.SERVICE, "publish", "jetserve.live.acme.gw.r"),
    (Role.SERVICE, "subscription", "_INBOX.tenant.acme.>"),
    (Role.SERVICE, "subscription", "jetserve.run.acme.>"),
    (Role.SERVICE, "subscription", "jetserve.api.>"),
    (Role.SERVICE, "publish", f"$JS.API.CONSUMER.CREATE.{TOPO.frames_stream}"),
    # ... nor a partition of the capture (docs/scale.md: a fleet may run several).
    (Role.SERVICE, "subscription", "jetserve.reply.acme.p1.*.*"),
    (Role.SERVICE, "publish", f"$JS.API.CONSUMER.CREATE.{TOPO.frames_stream}_1"),
    (Role.SERVICE, "publish", f"$JS.API.STREAM.DELETE.{TOPO.stream}"),
    (Role.SERVICE, "publish", f"$KV.{ROUTES_BUCKET}.sim-8b"),
    # A worker: the routes bucket, the NATS-native API, other streams and consumers.
    (Role.WORKER, "publish", f"$KV.{ROUTES_BUCKET}.sim-8b"),
    (Role.WORKER, "publish", f"$JS.API.STREAM.UPDATE.KV_{ROUTES_BUCKET}"),
    (Role.WORKER, "subscription", "jetserve.api.>"),
    (Role.WORKER, "publish", "jetserve.api.chat"),
    (Role.WORKER, "publish", f"$JS.API.STREAM.UPDATE.{TOPO.stream}"),
    (Role.WORKER, "publish", f"$JS.API.CONSUMER.CREATE.{TOPO.stream}.mine"),
    (Role.WORKER, "publish", f"$JS.API.CONSUMER.CREATE.{TOPO.stream}.mine.jetserve.pool.x.batch"),
    (Role.WORKER, "publish", "$JS.API.CONSUMER.MSG.NEXT.JETSERVE_AGENT.agent-executor"),
    (Role.WORKER, "publish", request_subject(RequestClass.INTERACTIVE)),
    (Role.WORKER, "subscription", "_INBOX.gateway.>"),
    # The agent executor: the routes bucket, the API, the request path's streams.
    (Role.AGENT, "publish", f"$KV.{ROUTES_BUCKET}.sim-8b"),
    (Role.AGENT, "subscription", "jetserve.api.>"),
    (Role.AGENT, "publish", request_subject(RequestClass.INTERACTIVE)),
    (Role.AGENT, "publish", f"$JS.API.STREAM.DELETE.{TOPO.stream}"),
    # A tool server answers calls; it publishes nothing of its own.
    (Role.TOOLS, "publish", request_subject(RequestClass.INTERACTIVE)),
    (Role.TOOLS, "subscription", "jetserve.reply.>"),
    (Role.TOOLS, "subscription", "jetserve.live.>"),
    # The fleet's KV index: workers tell it, gateways hear it, nobody else either.
    (Role.SERVICE, "publish", KV_INDEX_SUBJECT),
    (Role.SERVICE, "subscription", KV_INDEX_SUBJECT),
    (Role.AGENT, "publish", KV_INDEX_SUBJECT),
    (Role.WORKER, "subscription", KV_INDEX_SUBJECT),
    (Role.GATEWAY, "publish", KV_INDEX_SUBJECT),
    # Even the gateway may not delete or purge a stream.
    (Role.GATEWAY, "publish", f"$JS.API.STREAM.DELETE.{TOPO.stream}"),
    (Role.GATEWAY, "publish", f"$JS.API.STREAM.PURGE.{TOPO.frames_stream}"),
    # ... nor lower the ledger's limits (a purge by another name: max_msgs=1).
    (Role.GATEWAY, "publish", f"$JS.API.STREAM.UPDATE.{DEFAULT_LEDGER.stream}"),
    # A worker or an executor may create the streams of its buckets, never change
    # them: with the API's subjects added to one it could read, its credential
    # recorded every tenant's keys, prompts and answers.
    *((Role.WORKER, "publish", f"$JS.API.STREAM.UPDATE.KV_{b}") for b in WORKER_BUCKETS),
    *((Role.AGENT, "publish", f"$JS.API.STREAM.UPDATE.{s}") for s in AGENT_STREAMS),
]


@pytest.mark.parametrize(("role", "what", "subject"), FORBIDDEN)
async def test_the_server_refuses_what_a_role_may_not_do(
    fleet: Fleet, as_role: Connector, role: Role, what: str, subject: str
) -> None:
    probe: Probe = await as_role(role, "demo" if role is Role.SERVICE else None)
    before = await _messages(fleet, TOPO.stream)
    if what == "publish":
        await probe.nc.publish(subject, json.dumps(BODY).encode())
    else:
        await probe.nc.subscribe(subject)
    await probe.nc.flush()
    assert await probe.refused(what, subject), probe.errors
    assert await _messages(fleet, TOPO.stream) == before  # nothing queued for a worker


async def test_nothing_reached_the_routes_bucket_or_the_stream(fleet: Fleet) -> None:
    """After the forbidden steps above: the routes bucket holds no key they wrote
    and the work queue and its delivered counts are what the gateway put there."""
    nc = await fleet.connect(Role.ADMIN)
    try:
        kv = await nc.jetstream().key_value(ROUTES_BUCKET)
        assert "sim-8b" not in (await _keys(kv))
        info = await nc.jetstream().consumer_info(
            TOPO.stream, TOPO.consumer_name(RequestClass.INTERACTIVE)
        )
        assert info.delivered.stream_seq == 0  # no worker got anything
    finally:
        await nc.close()


async def _keys(kv: KeyValue) -> list[str]:
    try:
        return list(await kv.keys())
    except NoKeysError:
        return []


async def test_what_a_service_may_do_works(fleet: Fleet, as_role: Connector) -> None:
    """The control: a service's request on the API, answered on its own inbox."""
    probe: Probe = await as_role(Role.SERVICE, "demo")
    hdrs = {"Authorization": f"Bearer {fleet.api_key}"}
    reply = await probe.nc.request(INGRESS_CHAT, json.dumps(BODY).encode(), 10, headers=hdrs)
    assert reply.headers is not None
    assert reply.headers["Jetserve-Status"] == "200"
    assert probe.errors == []


@pytest.mark.parametrize(
    "target",
    [
        f"$JS.API.STREAM.DELETE.{TOPO.dlq_stream}",
        request_subject(RequestClass.BATCH),
        "jetserve.reply.demo.gw.x",
        "_INBOX.tenant.acme.stolen",  # another tenant's inbox
        "_INBOX.tenant.demo.*",  # a wildcard
    ],
)
async def test_stream_to_outside_the_callers_inbox_is_refused_before_admission(
    fleet: Fleet, as_role: Connector, target: str
) -> None:
    probe: Probe = await as_role(Role.SERVICE, "demo")
    watcher = await fleet.connect(Role.ADMIN)
    seen: list[bytes] = []

    async def record(msg: Msg) -> None:
        seen.append(msg.data)

    await watcher.subscribe(target, cb=record)
    await watcher.flush()
    before = await _messages(fleet, TOPO.stream)
    try:
        hdrs = {"Authorization": f"Bearer {fleet.api_key}", "Jetserve-Stream-To": target}
        body = json.dumps({**BODY, "stream": True}).encode()
        reply = await probe.nc.request(INGRESS_CHAT, body, 10, headers=hdrs)
        assert reply.headers is not None
        assert reply.headers["Jetserve-Status"] == "403"
        assert msgspec.json.decode(reply.data)["error"]["code"] == "reply_target_forbidden"
        await watcher.flush()  # whatever the gateway had published reached us by now
        assert seen == []
        assert await _messages(fleet, TOPO.stream) == before  # not admitted, not queued
    finally:
        await watcher.close()


async def test_a_reply_subject_outside_the_callers_inbox_is_dropped(
    fleet: Fleet, as_role: Connector
) -> None:
    """The reply subject is the target of the answer: an internal subject there
    is never published to, and the request is not served."""
    probe: Probe = await as_role(Role.SERVICE, "demo")
    watcher = await fleet.connect(Role.ADMIN)
    seen: list[bytes] = []

    async def record(msg: Msg) -> None:
        seen.append(msg.data)

    target = request_subject(RequestClass.INTERACTIVE)
    await watcher.subscribe(target, cb=record)
    await watcher.flush()
    before = await _messages(fleet, TOPO.stream)
    log = fleet.workdir / "gateway0.log"
    dropped_before = log.read_text().count("dropped a request")
    try:
        hdrs = {"Authorization": f"Bearer {fleet.api_key}"}
        await probe.nc.publish(INGRESS_CHAT, json.dumps(BODY).encode(), reply=target, headers=hdrs)
        await probe.nc.flush()
        await _dropped_since(log, dropped_before)
        await watcher.flush()
        assert seen == []  # the service's own publish is refused; the gateway sent nothing
        assert await _messages(fleet, TOPO.stream) == before
    finally:
        await watcher.close()


async def test_a_bad_body_with_a_reply_to_another_tenant_is_never_answered_there(
    fleet: Fleet, as_role: Connector
) -> None:
    """Demo's key, a body that does not parse, and acme's inbox as the reply: the
    reply subject is checked against the key before the body is read, so acme's
    inbox gets nothing (it used to get the 400, quoting the parse error)."""
    probe: Probe = await as_role(Role.SERVICE, "demo")
    watcher = await fleet.connect(Role.ADMIN)
    seen: list[bytes] = []

    async def record(msg: Msg) -> None:
        seen.append(msg.data)

    await watcher.subscribe("_INBOX.tenant.acme.>", cb=record)
    await watcher.flush()
    log = fleet.workdir / "gateway0.log"
    dropped_before = log.read_text().count("dropped a request")
    try:
        hdrs = {"Authorization": f"Bearer {fleet.api_key}"}
        victim = "_INBOX.tenant.acme.victim.1"
        await probe.nc.publish(INGRESS_CHAT, b'{"messages": "x"}', reply=victim, headers=hdrs)
        await probe.nc.flush()
        await _dropped_since(log, dropped_before)
        await watcher.flush()
        assert seen == []
    finally:
        await watcher.close()


async def _dropped_since(log: Path, before: int) -> None:
    """Until the gateway's log says it dropped one more request."""

    def dropped() -> bool:
        return log.read_text().count("dropped a request") > before

    await until_sync(dropped, "the gateway to drop the request", WITHIN_S)


async def test_connecting_without_a_credential_is_refused(fleet: Fleet) -> None:
    anon = Client()
    try:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await anon.connect(fleet.nats_url, allow_reconnect=False, max_reconnect_attempts=0)
    finally:
        await anon.close()
    assert fleet.redis is not None
    anonymous = redis.Redis(port=fleet.redis.port)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    anonymous.close()


def test_redis_users_touch_only_their_own_keys(fleet: Fleet) -> None:
    assert fleet.creds is not None
    assert fleet.redis is not None

    creds, port = fleet.creds, fleet.redis.port

    def as_user(user: str) -> redis.Redis:
        return redis.Redis(port=port, username=user, password=creds.redis_password(user))

    gateway, agent = as_user("gateway"), as_user("agent")
    try:
        assert gateway.set("jetserve:probe", "1")
        assert agent.set("demobank:probe", "1")
        for client, key in ((gateway, "demobank:probe"), (agent, "jetserve:probe")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.get(key)
        # API keys, limits and spend are the gateway's alone.
        with pytest.raises(redis.exceptions.NoPermissionError):
            agent.keys("jetserve:apikey:*")
        for client in (gateway, agent):
            for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("ACL", "LIST")):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)  # type: ignore[no-untyped-call]
    finally:
        gateway.close()
        agent.close()

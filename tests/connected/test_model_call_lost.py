"""An agent's model call whose answer was lost (workers/agent/model.py), against
a real nats-server.

A NATS node killed under agent runs (tests/faults/test_agent_faults.py) left,
now and then, a run waiting for its model call until the run's deadline: the
step's successor re-published the call's request id, the work queue deduped it
(a worker had already taken and acked it), and every frame of the short answer
had gone with the node, from the capture and from the live subject. Here a
"worker" takes and acks the request and sends nothing: the call must fail
retryable (``answer_lost``) within a few heartbeat timeouts, not wait out the
deadline; and a request still in the queue must keep being waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from jetserve.services import Service
from streams.agent import Budget, ModelCall, Run
from streams.auth import Role
from streams.connect import connect
from streams.definitions import DEFAULT_TOPOLOGY
from streams.provision import ensure_topology
from streams.subjects import RequestClass, live_subject, request_subject
from streams.wire import Final, Token, Usage, decode_request, encode
from tests.waits import until
from workers.agent.errors import ModelCallFailed
from workers.agent.model import ModelClient

pytestmark = pytest.mark.connected

HEARTBEAT_S = 0.3
TOPO = DEFAULT_TOPOLOGY
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Counted(ModelClient):
    """The real model client, counting its still-in-the-queue checks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.checks = 0
        real = self._client.still_queued

        async def counted(at: tuple[str, int]) -> bool | None:
            out = await real(at)
            self.checks += 1
            return out

        self._client.still_queued = counted  # type: ignore[method-assign]


async def _conn(server: Service, name: str, role: Role) -> Client:
    return await connect(f"nats://127.0.0.1:{server.port}", name, server.bus_auth(role))


@pytest.fixture
async def bus(nats_server: Service) -> AsyncIterator[tuple[Counted, Client]]:
    """An executor's model client and a worker's connection, the topology provisioned."""
    admin = await _conn(nats_server, "admin", Role.ADMIN)
    await ensure_topology(admin.jetstream(), TOPO)
    await admin.close()
    agent = await _conn(nats_server, "agent", Role.AGENT)
    worker = await _conn(nats_server, "worker", Role.WORKER)
    yield Counted(agent, agent.jetstream(), "exec-1", TOPO, HEARTBEAT_S), worker
    await agent.close()
    await worker.close()


def _run() -> tuple[Run, ModelCall]:
    now = time.time()
    run = Run(id="run_lost", tenant="demo", model="sim", deadline=now + 120, budget=Budget())
    return run, ModelCall(request_id="run_lost-1-1", step=1, started=now)


async def _take(worker: Client) -> tuple[str, Msg]:
    """A worker's pull of the agent class: the request's reply subject and message."""
    sub = await worker.jetstream().pull_subscribe_bind(
        TOPO.consumer_name(RequestClass.AGENT), TOPO.stream_of(RequestClass.AGENT)
    )
    (msg,) = await sub.fetch(1, timeout=10)
    return decode_request(msg.data).reply, msg


async def test_a_taken_request_whose_answer_never_comes_fails_retryable(
    bus: tuple[Counted, Client],
) -> None:
    models, worker = bus
    run, call = _run()
    # The first owner's publish; a worker takes it and acks at its first token,
    # whose frames (all of a short answer) are lost with a dying node.
    first = models.request(run, call, BODY)
    await models._client.publish(request_subject(RequestClass.AGENT), first)
    _, msg = await _take(worker)
    await msg.ack_sync()

    with pytest.raises(ModelCallFailed) as failed:
        await models.call(run, call, BODY, lambda: None)  # the successor's re-publish
    assert failed.value.code == "answer_lost"
    assert failed.value.retryable
    # Given up at the heartbeat timeout after the one check that found it gone,
    # not at the run's deadline (120 s), which the old code waited out (the
    # test's 60 s timeout fails it there).
    assert models.checks == 1


async def test_a_request_still_queued_is_waited_for_and_its_answer_read(
    bus: tuple[Counted, Client],
) -> None:
    models, worker = bus
    run, call = _run()
    calling = asyncio.create_task(models.call(run, call, BODY, lambda: None))

    async def waited_on() -> bool:
        assert not calling.done(), calling
        return models.checks >= 3

    await until(waited_on, "three heartbeat timeouts with the request queued")
    reply, msg = await _take(worker)
    await msg.ack_sync()
    live = live_subject(str(reply))
    await worker.publish(live, encode(Token(seq=1, text="hello")))
    await worker.publish(live, encode(Final(seq=2, finish_reason="stop", usage=Usage(3, 1))))
    answer = await asyncio.wait_for(calling, 30)
    assert answer.content == "hello"
    assert answer.usage == Usage(3, 1)

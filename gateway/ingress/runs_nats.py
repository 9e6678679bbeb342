"""Agent runs over NATS request/reply, for services that do not speak HTTP.

Subjects (queue group shared by every gateway replica), header
``Authorization: Bearer <key>``, JSON bodies:

    jetserve.api.runs.create    the POST /v1/runs body (header Idempotency-Key too)
    jetserve.api.runs.get       {"run_id": ...}
    jetserve.api.runs.approve   {"run_id": ..., "call_id": ..., "approve": bool, "reason": ...}
                                (a key with the approve scope, not the run's creator: else 403)
    jetserve.api.runs.cancel    {"run_id": ...}

The reply is the run (as ``GET /v1/runs/{id}`` shows it) or the decision, with
header ``Jetserve-Status``; an error is OpenAI error JSON with its status. The
reply subject must be an inbox of the key's own tenant (nats_targets.py), or the
request is dropped unanswered.
Events: subscribe to ``jetserve.run.<tenant>.<run id>`` (live: a service's
credential has no JetStream API; a replay from any event is ``GET
/v1/runs/{id}/events`` with ``Last-Event-ID``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gateway.decoding import decode_body
from gateway.errors import GatewayError
from gateway.ingress.nats_api import QUEUE_GROUP, STATUS
from gateway.ingress.nats_targets import inbox_tenant
from gateway.ingress.nats_tasks import PENDING_BYTES, PENDING_MSGS, IngressTasks, Known
from gateway.runs.service import RunsService
from gateway.runs.views import view
from gateway.tenancy.tenant_slots import TenantSlots
from streams.subjects import INGRESS_RUNS

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
OPS = ("create", "get", "approve", "cancel")


class _Ref(msgspec.Struct, frozen=True):
    run_id: str


class _Approve(msgspec.Struct, frozen=True):
    run_id: str
    call_id: str
    approve: bool
    reason: str = ""


class RunsNatsIngress:
    def __init__(self, nc: Client, runs: RunsService) -> None:
        self._nc = nc
        self._runs = runs
        self._subs: list[Subscription] = []
        unknown = runs.gw.metrics.nats_unauthenticated.labels("runs")
        self.work = IngressTasks(runs.gw.cfg.nats_max_unauthenticated, unknown)  # owned: see stop()
        # Per tenant (authenticated), as the inference ingress: a flood of one
        # tenant's gets grew the gateway's tasks without bound.
        self.slots = TenantSlots(runs.gw.cfg.nats_max_inflight)

    async def start(self) -> None:
        for op in OPS:
            self._subs.append(
                await self._nc.subscribe(
                    f"{INGRESS_RUNS}.{op}",
                    QUEUE_GROUP,
                    cb=self._on_msg,
                    pending_bytes_limit=PENDING_BYTES,
                    pending_msgs_limit=PENDING_MSGS,
                )
            )

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        if self.work.tasks:
            await asyncio.wait(self.work.tasks, timeout=10)

    async def _on_msg(self, msg: Msg) -> None:
        await self.work.spawn(lambda known: self._serve(msg, known))

    async def _serve(self, msg: Msg, known: Known) -> None:
        headers = {k.lower(): v for k, v in (msg.headers or {}).items()}
        auth = headers.get("authorization")
        op = msg.subject.rsplit(".", 1)[-1]
        reply = msg.reply
        if inbox_tenant(reply) is None:  # nowhere safe to answer (nats_targets.py)
            log.warning("runs ingress: dropped a request on %s: no tenant inbox", msg.subject)
            return
        try:
            key = await self._runs.gw.tenancy.authenticate(auth)
            known()
            if inbox_tenant(reply) != key.tenant:
                log.warning("runs ingress: dropped a request: reply to another tenant's inbox")
                return
            with self.slots.held(key.tenant):
                status, body = await self._op(op, auth, msg.data, headers)
        except GatewayError as exc:
            status, body = exc.status, exc.body()
        await self._nc.publish(reply, _encoder.encode(body), headers={STATUS: str(status)})

    async def _op(
        self, op: str, auth: str | None, data: bytes, headers: dict[str, str]
    ) -> tuple[int, Any]:
        if op == "create":
            run, replayed = await self._runs.create(data, headers)
            return (200 if replayed else 201), view(run)
        if op == "approve":
            a = decode_body(data, _Approve)
            body = _encoder.encode({"approve": a.approve, "reason": a.reason})
            return 202, await self._runs.decide(auth, a.run_id, a.call_id, body)
        ref = decode_body(data, _Ref)
        if op == "get":
            return 200, view(await self._runs.get(auth, ref.run_id))
        run = await self._runs.cancel(auth, ref.run_id)
        return 202, view(run)

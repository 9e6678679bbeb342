"""Remote tools: a tool served on a NATS subject by any process, in any language.

Server side: :func:`serve_tool` hosts an async tool function as a NATS service
(``nats.micro``: discoverable with ``$SRV.PING|INFO|STATS``, queue group so
that any number of replicas share the load). Client side: :func:`call_remote`
and :func:`reconcile_remote`, used by the dispatcher.

The wire is plain JSON (see ``tools.wire``): a request ``{"args", "ctx"}`` and a
reply ``{"result"}`` or ``{"error", "retryable"}``. A service written with
another NATS micro library may instead answer with the standard
``Nats-Service-Error``/``Nats-Service-Error-Code`` headers: a 4xx code is a
definite failure, anything else means the tool crashed (the effect is unknown).

How a call can fail, as the dispatcher sees it:

- nobody serves the subject (no responders) -> :class:`NotDeliveredError`: the
  effect certainly did not happen, retryable;
- no reply in time -> :class:`ToolTimeoutError`: the effect is unknown;
- a 5xx service error -> :class:`ToolCrashedError`: the effect is unknown.

Headers: ``traceparent`` and ``Jetserve-Deadline`` travel with each call.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionClosedError, ConnectionDrainingError, NoRespondersError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.micro import add_service
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from nats.micro.service import EndpointConfig, Service, ServiceConfig

from streams.headers import Header
from streams.logs import frames_of
from tools.errors import (
    EffectUnknownError,
    NotDeliveredError,
    ToolCrashedError,
    ToolFailure,
    ToolTimeoutError,
)
from tools.registry import Reconcile, ToolFn, reconcile_subject
from tools.wire import (
    Outcome,
    ReconcileRequest,
    RemoteCall,
    ToolContext,
    decode_call,
    decode_reconcile_reply,
    decode_reconcile_request,
    decode_reply,
    encode,
    encode_reply,
    to_json_value,
)

log = logging.getLogger(__name__)

_SERVICE_NAME = re.compile(r"[^A-Za-z0-9_-]")


def _headers(ctx: ToolContext) -> dict[str, str] | None:
    h: dict[str, str] = {}
    if ctx.traceparent:
        h[Header.TRACEPARENT] = ctx.traceparent
    if ctx.deadline:
        h[Header.DEADLINE] = f"{ctx.deadline:.3f}"
    return h or None


async def call_remote(
    nc: Client, subject: str, args: dict[str, Any], ctx: ToolContext, timeout_s: float
) -> Outcome:
    """Call a remote tool. A definite answer (success or the tool's own error)
    is an :class:`Outcome`; otherwise raises a :class:`ToolCallError`."""
    payload = encode(RemoteCall(args=args, ctx=ctx))
    try:
        msg = await nc.request(subject, payload, timeout=timeout_s, headers=_headers(ctx))
    except NoRespondersError:
        raise NotDeliveredError(f"no responders on {subject}") from None
    except (ConnectionClosedError, ConnectionDrainingError) as exc:
        raise NotDeliveredError(f"not sent: {exc}") from None
    except NatsTimeoutError:
        raise ToolTimeoutError("timeout") from None
    except NatsError as exc:
        raise EffectUnknownError(f"remote call failed: {exc}") from exc
    if msg.headers and ERROR_HEADER in msg.headers:
        code = msg.headers.get(ERROR_CODE_HEADER, "500")
        desc = msg.headers[ERROR_HEADER]
        if code.startswith("4"):
            return Outcome.failure(desc, retryable=False)
        raise ToolCrashedError(f"remote tool error {code}: {desc}")
    try:
        reply = decode_reply(msg.data)
    except msgspec.DecodeError as exc:
        raise ToolCrashedError(f"malformed reply from {subject}: {exc}") from None
    if reply.error is not None:
        return Outcome.failure(reply.error, reply.retryable)
    return Outcome.success(reply.result)


async def reconcile_remote(nc: Client, subject: str, key: str, timeout_s: float) -> Outcome | None:
    """Ask a remote tool's reconcile endpoint about ``key``. Raises a
    :class:`ToolCallError` when it cannot answer."""
    rsubject = reconcile_subject(subject)
    try:
        msg = await nc.request(rsubject, encode(ReconcileRequest(key)), timeout=timeout_s)
    except NoRespondersError:
        raise NotDeliveredError(f"no responders on {rsubject}") from None
    except NatsTimeoutError:
        raise ToolTimeoutError("reconcile timeout") from None
    except NatsError as exc:
        raise EffectUnknownError(f"reconcile failed: {exc}") from exc
    if msg.headers and ERROR_HEADER in msg.headers:
        raise EffectUnknownError(f"reconcile failed: {msg.headers[ERROR_HEADER]}")
    try:
        reply = decode_reconcile_reply(msg.data)
    except msgspec.DecodeError as exc:
        raise EffectUnknownError(f"malformed reconcile reply: {exc}") from None
    if reply.error is not None:
        raise EffectUnknownError(f"reconcile cannot tell: {reply.error}")
    if not reply.done:
        return None
    return reply.outcome or Outcome.success(None)


class ToolServer:
    """A tool hosted on NATS. Stop it with :meth:`stop` (waits for calls in flight)."""

    def __init__(
        self,
        nc: Client,
        fn: ToolFn,
        subject: str,
        reconcile: Reconcile | None,
        max_inflight: int,
        grace_s: float,
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.service: Service | None = None
        self._fn = fn
        self._reconcile = reconcile
        self._slots = asyncio.Semaphore(max_inflight)
        self._grace_s = grace_s
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        # micro awaits a handler before taking the next message of its
        # subscription: hand each call to a task so a slow call never blocks others.
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_call(self, req: Request) -> None:
        self._spawn(self._call(req))

    async def _on_reconcile(self, req: Request) -> None:
        self._spawn(self._reconcile_one(req))

    async def _call(self, req: Request) -> None:
        async with self._slots:
            try:
                call = decode_call(req.data)
            except msgspec.DecodeError as exc:
                await _respond(req, encode_reply(Outcome.failure(f"bad request: {exc}")))
                return
            ctx = call.ctx
            budget: float | None = None
            if ctx.deadline:
                budget = ctx.deadline - time.time()
                if budget <= 0:  # nothing ran: a definite, final answer
                    await _respond(req, encode_reply(Outcome.failure("deadline exceeded")))
                    return
                budget += self._grace_s
            try:
                async with asyncio.timeout(budget) as cm:
                    result = await self._fn(call.args, ctx)
                out = Outcome.success(to_json_value(result))
            except ToolFailure as f:
                out = Outcome.failure(f.message, f.retryable)
            except TimeoutError as exc:
                if cm.expired():
                    # Past the caller's deadline: it has given up; nobody to tell.
                    log.warning("tool %s: cancelled past the deadline", self.subject)
                    return
                await _respond_error(req, "500", f"TimeoutError: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 -- reported as a 500: effect unknown
                # Where, not what: its message may quote the call's arguments.
                log.warning("tool %s raised %s", self.subject, type(exc).__name__)
                log.debug("tool %s raised at\n%s", self.subject, frames_of(exc))
                await _respond_error(req, "500", f"{type(exc).__name__}: {exc}")
                return
            await _respond(req, encode_reply(out))

    async def _reconcile_one(self, req: Request) -> None:
        assert self._reconcile is not None
        async with self._slots:
            try:
                key = decode_reconcile_request(req.data).key
                found = await self._reconcile(key)
            except Exception as exc:  # noqa: BLE001 - "cannot tell" is an answer
                await _respond(req, encode({"error": f"{type(exc).__name__}: {exc}"}))
                return
            if found is None:
                await _respond(req, encode({"done": False}))
            else:
                await _respond(req, encode({"done": True, "outcome": found}))

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def _respond(req: Request, data: bytes) -> None:
    try:
        await req.respond(data)
    except NatsError as exc:
        log.warning("tool reply to %s lost: %s", req.subject, exc)


async def _respond_error(req: Request, code: str, description: str) -> None:
    try:
        await req.respond_error(code, description, data=encode({"error": description}))
    except NatsError as exc:
        log.warning("tool reply to %s lost: %s", req.subject, exc)


async def serve_tool(
    nc: Client,
    tool_impl: ToolFn,
    subject: str,
    queue: str = "tools",
    *,
    reconcile: Reconcile | None = None,
    name: str | None = None,
    version: str = "1.0.0",
    description: str = "",
    max_inflight: int = 256,
    grace_s: float = 1.0,
) -> ToolServer:
    """Serve ``tool_impl`` on ``subject`` (queue group ``queue``), and, given a
    ``reconcile``, its reconcile endpoint on ``<subject>.reconcile``. Register
    it with ``Tool(..., runs=Remote(subject, reconcile=reconcile is not None))``.
    """
    server = ToolServer(nc, tool_impl, subject, reconcile, max_inflight, grace_s)
    svc = await add_service(
        nc,
        ServiceConfig(
            name=name or _SERVICE_NAME.sub("_", subject),
            version=version,
            description=description or f"jetserve tool on {subject}",
            metadata={"jetserve.tool.subject": subject},
            queue_group=queue,
        ),
    )
    await svc.add_endpoint(EndpointConfig(name="call", handler=server._on_call, subject=subject))
    if reconcile is not None:
        await svc.add_endpoint(
            EndpointConfig(
                name="reconcile", handler=server._on_reconcile, subject=reconcile_subject(subject)
            )
        )
    await nc.flush()  # subscriptions are live on the server when we return
    server.service = svc
    return server

"""Model calls of agent runs, through the same inference subjects as every
other request (class ``agent``): an :class:`InferenceRequest` on
``jetserve.req.agent``, frames back on a reply subject.

The frames are read from the frames capture (``JETSERVE_FRAMES``, an ordered
consumer from the start), not from a live subscription: an executor that takes
over a step whose owner died mid-call re-publishes the same request id (the
work queue's ``Nats-Msg-Id`` dedupe makes that a no-op when the first publish
landed) and reads the answer the first owner's call produced. The call is made,
and charged, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError

from streams.agent import ModelCall, Run
from streams.definitions import Topology
from streams.headers import Header
from streams.subjects import (
    RequestClass,
    cancel_subject,
    frames_filter,
    reply_subject,
    request_subject,
)
from streams.wire import (
    Cancel,
    ErrorFrame,
    Final,
    Frame,
    Heartbeat,
    InferenceRequest,
    Meta,
    Token,
    Usage,
    decode_frame,
    encode,
)
from workers.agent.errors import ModelCallFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelReply:
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    usage: Usage

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def estimate_tokens(body: dict[str, Any]) -> int:
    """A rough prompt size for KV admission (about 4 bytes a token)."""
    size = len(msgspec.json.encode(body.get("messages", []))) + len(
        msgspec.json.encode(body.get("tools", []))
    )
    return size // 4 + 1


def merge_tool_calls(acc: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Fold OpenAI streaming tool-call deltas (by ``index``) into whole calls."""
    for d in deltas:
        i = int(d.get("index", 0))
        cur = acc.setdefault(
            i, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if d.get("id"):
            cur["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            cur["function"]["name"] = fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str):
            cur["function"]["arguments"] += args
        elif args is not None:  # an engine that sends an object: keep it as JSON text
            cur["function"]["arguments"] += msgspec.json.encode(args).decode()


class ModelClient:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        executor_id: str,
        topology: Topology,
        heartbeat_timeout_s: float,
    ) -> None:
        self._nc = nc
        self._js = js
        self._id = executor_id
        self._topo = topology
        self._heartbeat_timeout = heartbeat_timeout_s

    def request(self, run: Run, call: ModelCall, body: dict[str, Any]) -> InferenceRequest:
        return InferenceRequest(
            id=call.request_id,
            op="chat",
            cls=RequestClass.AGENT.value,
            model=run.model,
            body=body,
            reply=reply_subject(run.tenant, self._id, call.request_id),
            deadline=run.deadline,
            tenant=run.tenant,
            key_id=run.key_id,
            traceparent=run.traceparent,
            prompt_tokens_est=estimate_tokens(body),
            max_tokens=int(body.get("max_tokens") or 0),
            created=call.started,
        )

    async def call(
        self, run: Run, call: ModelCall, body: dict[str, Any], on_published: Callable[[], None]
    ) -> ModelReply:
        """Publish (or re-publish) the step's request and read its answer."""
        frames: asyncio.Queue[Frame] = asyncio.Queue()

        async def on_frame(msg: Msg) -> None:
            try:
                frames.put_nowait(decode_frame(msg.data))
            except msgspec.DecodeError:
                log.warning("run %s: undecodable frame dropped", run.id)

        sub = await self._js.subscribe(
            frames_filter(run.tenant, call.request_id),
            stream=self._topo.frames_stream,
            cb=on_frame,
            ordered_consumer=True,
        )
        try:
            await self._publish(self.request(run, call, body))
            on_published()
            return await self._collect(frames, run.deadline)
        except asyncio.CancelledError:
            # Interrupted (a cancel of the run): stop the engine now, GPU time included.
            with contextlib.suppress(nats.errors.Error):
                cancel = Cancel(call.request_id, "run_cancelled")
                await self._nc.publish(cancel_subject(call.request_id), encode(cancel))
            raise
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _publish(self, req: InferenceRequest) -> None:
        headers = {Header.MSG_ID.value: req.id, Header.DEADLINE.value: f"{req.deadline:.3f}"}
        if req.traceparent:
            headers[Header.TRACEPARENT.value] = req.traceparent
        try:
            await self._js.publish(
                request_subject(RequestClass.AGENT), encode(req), headers=headers, timeout=5.0
            )
        except APIError as exc:
            raise ModelCallFailed(
                f"could not enqueue the model call: {exc.description}",
                code="queue_full",
                retryable=True,
            ) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise ModelCallFailed(
                f"could not enqueue the model call: {exc!r}", code="bus_unavailable", retryable=True
            ) from exc

    async def _collect(self, frames: asyncio.Queue[Frame], deadline: float) -> ModelReply:
        attempt: int | None = None  # the delivery whose tokens we keep
        last_seq = 0
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        while True:
            # Before the first token only the deadline ends the wait (the request
            # may be queued, or redelivered); after it, silence means a dead worker.
            timeout = self._heartbeat_timeout
            if attempt is None:
                timeout = deadline - time.time() + 0.5
            try:
                frame = await asyncio.wait_for(frames.get(), max(timeout, 0.0))
            except TimeoutError:
                if attempt is None:
                    raise ModelCallFailed(
                        "the model call did not answer before the run's deadline",
                        code="deadline_exceeded",
                        retryable=False,
                    ) from None
                raise ModelCallFailed(
                    "the worker stopped responding mid-stream",
                    code="stream_interrupted",
                    retryable=True,
                ) from None
            if isinstance(frame, Meta | Heartbeat):
                continue
            if attempt is not None and frame.attempt != attempt:
                continue  # a redelivered attempt racing the one we follow
            if isinstance(frame, Token):
                if frame.seq <= last_seq:
                    continue
                attempt = frame.attempt
                last_seq = frame.seq
                text.append(frame.text)
                if frame.tool_calls:
                    merge_tool_calls(calls, frame.tool_calls)
                continue
            if isinstance(frame, ErrorFrame):
                raise ModelCallFailed(
                    f"model call failed: {frame.code}: {frame.message}",
                    code=frame.code,
                    retryable=frame.retryable or frame.code == "stream_interrupted",
                )
            assert isinstance(frame, Final)
            tool_calls = [calls[i] for i in sorted(calls)]
            content = "".join(text)
            return ModelReply(
                content=content if content or not tool_calls else None,
                tool_calls=tool_calls,
                finish_reason=frame.finish_reason,
                usage=frame.usage,
            )

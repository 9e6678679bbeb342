"""Model calls of agent runs, through the same inference subjects as every
other request (class ``agent``): an :class:`InferenceRequest` on
``jetserve.req.agent``, frames back on a reply subject.

The frames are read from the frames capture (``JETSERVE_FRAMES``, or the
partition stream of the request id: streams/subjects.py; an ordered
consumer from the start), not from a live subscription: an executor that takes
over a step whose owner died mid-call re-publishes the same request id (the
work queue's ``Nats-Msg-Id`` dedupe makes that a no-op when the first publish
landed) and reads the answer the first owner's call produced. The call is made,
and charged, once.

Unless that answer was lost: a worker acks the request at its first token, and
a NATS node that dies then can take every frame of a short answer with it,
from the capture (its stream electing a leader) and from the live subject (no
one listening yet). Nothing would ever answer the re-published id, so the
call's frame reader watches, before the first token, that its request is still
in the work queue (streams/inference/frames.py); once it has been gone (taken
and acked) for a whole heartbeat timeout with still no frame, the answer counts
as lost: the call is cancelled and fails retryable (``answer_lost``), and the
step issues the next attempt under a new id. The lost attempt's tokens are not
in the run's spend: its usage never arrived.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from streams.agent import ModelCall, Run
from streams.definitions import Topology
from streams.errors import (
    AnswerLostError,
    BusUnavailableError,
    DeadlineExceededError,
    PublishError,
    RequestTooLargeError,
    StreamInterruptedError,
)
from streams.inference.client import InferenceClient
from streams.inference.frames import FrameBuffer, FrameReader, InOrder, QueuedAt
from streams.inference.tool_calls import ToolCalls
from streams.subjects import RequestClass, live_filter, reply_subject, request_subject
from streams.wire import ErrorFrame, InferenceRequest, Token, Usage, decode_frames
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
        self._client = InferenceClient(nc, js, topology)
        self._partitions = topology.frames_partitions
        self._id = executor_id
        self._heartbeat_timeout = heartbeat_timeout_s

    def request(self, run: Run, call: ModelCall, body: dict[str, Any]) -> InferenceRequest:
        return InferenceRequest(
            id=call.request_id,
            op="chat",
            cls=RequestClass.AGENT.value,
            model=run.model,
            body=body,
            reply=reply_subject(run.tenant, self._id, call.request_id, self._partitions),
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
        frames = FrameBuffer(limit=None)  # the capture replays at its own pace
        merged = InOrder(frames)

        async def on_frame(msg: Msg) -> None:
            try:
                for frame in decode_frames(msg.data):  # the capture batches tokens
                    merged.offer(frame)
            except msgspec.DecodeError:
                log.warning("run %s: undecodable frame dropped", run.id)

        # Live and from the capture: either alone can lose every frame of a
        # short answer while a NATS node dies (streams.inference.frames.InOrder).
        live = await self._nc.subscribe(
            live_filter(run.tenant, call.request_id, self._partitions), cb=on_frame
        )
        try:
            sub = await self._client.follow(run.tenant, call.request_id, on_frame)
        except BaseException:
            with contextlib.suppress(nats.errors.Error):
                await live.unsubscribe()
            raise
        try:
            ack = await self._publish(self.request(run, call, body))
            on_published()
            at: QueuedAt = (ack.stream, ack.seq)
            # Looked up at each check: a test counts them by replacing it.
            reader = FrameReader(
                frames, run.deadline, at, lambda where: self._client.still_queued(where)
            )
            return await self._collect(reader, call.request_id)
        finally:
            for each in (sub, live):
                with contextlib.suppress(nats.errors.Error):
                    await each.unsubscribe()

    async def cancel(self, call: ModelCall) -> None:
        """Stop the engine on this call, GPU time included: only for a cancel of
        the run. A step cancelled for any other reason (its lease lost, a drain)
        leaves the call running: whoever takes the step over re-publishes the
        same request id and reads the answer this call produces."""
        await self._client.cancel(call.request_id, "run_cancelled")

    async def _publish(self, req: InferenceRequest) -> PubAck:
        try:
            return await self._client.publish(request_subject(RequestClass.AGENT), req)
        except BusUnavailableError as exc:
            raise ModelCallFailed(
                f"could not enqueue the model call: {exc.message}",
                code="bus_unavailable",
                retryable=True,
            ) from exc
        except RequestTooLargeError as exc:
            # The conversation (and the tools' schemas) outgrew the bus's message:
            # no retry can send it. It was retried as a bus outage until the step
            # timed out, the run's lease and an executor slot held all along.
            raise ModelCallFailed(
                f"the model call is too large to enqueue: {exc.message}",
                code="request_too_large",
                retryable=False,
            ) from exc
        except PublishError as exc:
            raise ModelCallFailed(
                f"could not enqueue the model call: {exc.message}",
                code="queue_full",
                retryable=True,
            ) from exc

    async def _collect(self, reader: FrameReader, request_id: str) -> ModelReply:
        text: list[str] = []
        calls = ToolCalls()
        while True:
            try:
                event = await reader.next_event(self._heartbeat_timeout)
            except AnswerLostError:
                await self._client.cancel(request_id, "answer_lost")
                raise ModelCallFailed(
                    "a worker took the model call but its answer was lost",
                    code="answer_lost",
                    retryable=True,
                ) from None
            except DeadlineExceededError:
                raise ModelCallFailed(
                    "the model call did not answer before the run's deadline",
                    code="deadline_exceeded",
                    retryable=False,
                ) from None
            except StreamInterruptedError:
                raise ModelCallFailed(
                    "the worker stopped responding mid-stream",
                    code="stream_interrupted",
                    retryable=True,
                ) from None
            if isinstance(event, Token):
                text.append(event.text)
                if event.tool_calls:
                    calls.add(event.tool_calls)
                continue
            if isinstance(event, ErrorFrame):
                raise ModelCallFailed(
                    f"model call failed: {event.code}: {event.message}",
                    code=event.code,
                    retryable=event.retryable or event.code == "stream_interrupted",
                )
            tool_calls = calls.merged()
            content = "".join(text)
            return ModelReply(
                content=content if content or not tool_calls else None,
                tool_calls=tool_calls,
                finish_reason=event.finish_reason,
                usage=event.usage,
            )

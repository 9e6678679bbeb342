"""Declarative JetStream definitions: the work-queue stream and one durable
pull consumer per request class. Provisioning (``streams.provision``) makes the
server match these; nothing else creates streams or consumers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from streams.subjects import PREFIX, RequestClass, request_subject


@dataclass(frozen=True)
class Limits:
    """Bounds of the work queue. A full queue refuses new work (discard new ->
    the ingress answers 429) rather than silently dropping old, accepted work."""

    max_msgs: int = 100_000
    max_bytes: int = 1 << 30
    max_msg_size: int = 4 << 20
    duplicate_window_s: float = 120.0  # Nats-Msg-Id dedupe: gateway retries and Idempotency-Key
    max_age_s: float = 3600.0
    # Short ack_wait: a dead worker's message comes back quickly. Live workers
    # send in_progress() while waiting for the first token.
    ack_wait_s: float = 10.0
    max_deliver: int = 5
    max_waiting: int = 512  # concurrent pull requests per consumer


@dataclass(frozen=True)
class FramesLimits:
    """The short-lived capture of every reply frame, for resumable streams."""

    max_age_s: float = 600.0  # how long after a frame a client may still resume
    max_bytes: int = 512 << 20
    max_msg_size: int = 1 << 20


@dataclass(frozen=True)
class Topology:
    stream: str = "JETSERVE_REQ"
    frames_stream: str = "JETSERVE_FRAMES"
    dlq_stream: str = "JETSERVE_DLQ"
    # JetStream replicas of every stream (3 on a 3-node cluster: a node can die).
    replicas: int = 1
    dlq_max_age_s: float = 7 * 24 * 3600
    frames: FramesLimits = field(default_factory=FramesLimits)
    classes: tuple[RequestClass, ...] = tuple(RequestClass)
    limits: Limits = field(default_factory=Limits)

    def stream_config(self) -> StreamConfig:
        lim = self.limits
        return StreamConfig(
            name=self.stream,
            # Exactly the served class subjects: a publish to anything else fails
            # fast (no responders) instead of being stored and never consumed.
            subjects=[request_subject(c) for c in self.classes],
            retention=RetentionPolicy.WORK_QUEUE,
            discard=DiscardPolicy.NEW,
            storage=StorageType.FILE,
            max_msgs=lim.max_msgs,
            max_bytes=lim.max_bytes,
            max_msg_size=lim.max_msg_size,
            max_age=lim.max_age_s,
            duplicate_window=lim.duplicate_window_s,
            num_replicas=self.replicas,
        )

    def frames_config(self) -> StreamConfig:
        lim = self.frames
        # Memory storage: frames are hot and short-lived; losing them on a server
        # restart only loses the ability to resume, never accepted work.
        return StreamConfig(
            name=self.frames_stream,
            subjects=[f"{PREFIX}.reply.>"],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            storage=StorageType.MEMORY,
            max_age=lim.max_age_s,
            max_bytes=lim.max_bytes,
            max_msg_size=lim.max_msg_size,
            num_replicas=self.replicas,
        )

    def dlq_config(self) -> StreamConfig:
        # Kept on disk for a week: a poison message is evidence to look at.
        return StreamConfig(
            name=self.dlq_stream,
            subjects=[f"{PREFIX}.dlq.>"],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            max_age=self.dlq_max_age_s,
            max_bytes=1 << 30,
            num_replicas=self.replicas,
        )

    def consumer_name(self, cls: RequestClass | str) -> str:
        return f"workers-{RequestClass(cls).value}"

    def consumer_config(self, cls: RequestClass) -> ConsumerConfig:
        lim = self.limits
        # Work-queue consumers must not overlap: one class subject each.
        return ConsumerConfig(
            durable_name=self.consumer_name(cls),
            filter_subject=request_subject(cls),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=lim.ack_wait_s,
            max_deliver=lim.max_deliver,
            max_waiting=lim.max_waiting,
            max_ack_pending=-1,
        )


DEFAULT_TOPOLOGY = Topology()

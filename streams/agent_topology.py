"""Declarative JetStream definitions of agent runs, and their provisioning.

- ``JETSERVE_AGENT``: a work-queue stream of step nudges (``jetserve.agent.step``,
  consumer ``agent-executor``) and settlement requests (``jetserve.agent.settle``,
  consumer ``gateway-run-settle``); the two consumers' filters do not overlap.
- ``JETSERVE_RUN_EVENTS``: every run's events (``jetserve.run.<tenant>.<run>``),
  kept for resumable SSE (``Last-Event-ID`` = the event's stream sequence).
- KV ``JETSERVE_RUNS`` (file storage): run records, leases, decisions, cancels.

Inference calls of runs use the ordinary request stream (class ``agent``), which
``streams.provision.ensure_topology`` provisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from streams.provision import ensure_bucket, ensure_stream, patiently
from streams.subjects import AGENT_SETTLE, AGENT_STEP, RUN_EVENTS_WILDCARD

DAY_S = 86_400.0


@dataclass(frozen=True)
class AgentTopology:
    stream: str = "JETSERVE_AGENT"
    events_stream: str = "JETSERVE_RUN_EVENTS"
    bucket: str = "JETSERVE_RUNS"
    step_consumer: str = "agent-executor"
    settle_consumer: str = "gateway-run-settle"
    # A dead executor's step comes back this fast; a live one sends in_progress()
    # (with each lease renewal) while it works, however long the step takes.
    ack_wait_s: float = 5.0
    # Unlimited: a run's nudge must never be dropped for being redelivered often
    # (a parked or contended run is naked many times); poison is terminated by
    # the executor itself, with a reason.
    max_deliver: int = -1
    # Unlimited: executors bound their own concurrency (they pull only with a free
    # slot), and every parked run holds one pending message (its deadline timer).
    max_ack_pending: int = -1
    duplicate_window_s: float = 120.0  # Nats-Msg-Id dedupe of nudges and events
    max_msgs: int = 1_000_000
    events_max_age_s: float = 7 * DAY_S
    events_max_bytes: int = 1 << 30
    runs_ttl_s: float = 30 * DAY_S  # records (and their leases) outlive any run
    # A run record holds the conversation; past this its owner fails the run
    # with a reason instead of losing writes.
    max_record_bytes: int = 1 << 20
    replicas: int = 1  # JetStream replicas of the streams and the bucket (3 on a cluster)

    def stream_config(self) -> StreamConfig:
        return StreamConfig(
            name=self.stream,
            subjects=[AGENT_STEP, AGENT_SETTLE],
            retention=RetentionPolicy.WORK_QUEUE,
            # Refuse new work when full rather than drop an accepted run's step.
            discard=DiscardPolicy.NEW,
            storage=StorageType.FILE,
            max_msgs=self.max_msgs,
            max_msg_size=64 << 10,  # nudges are ids and a number
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
        )

    def events_config(self) -> StreamConfig:
        return StreamConfig(
            name=self.events_stream,
            subjects=[RUN_EVENTS_WILDCARD],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            max_age=self.events_max_age_s,
            max_bytes=self.events_max_bytes,
            max_msg_size=self.max_record_bytes,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
        )

    def step_consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.step_consumer,
            filter_subject=AGENT_STEP,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            max_waiting=512,
            max_ack_pending=self.max_ack_pending,
        )

    def settle_consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.settle_consumer,
            filter_subject=AGENT_SETTLE,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0,
            max_deliver=-1,
            max_waiting=64,
        )

    def kv_config(self) -> KeyValueConfig:
        return KeyValueConfig(
            bucket=self.bucket,
            description="jetserve agent runs: records, leases, approvals, cancels",
            history=1,
            ttl=self.runs_ttl_s,
            max_value_size=self.max_record_bytes,
            storage=StorageType.FILE,
            replicas=self.replicas,
        )


DEFAULT_AGENT = AgentTopology()


async def ensure_agent(
    js: JetStreamContext, topo: AgentTopology = DEFAULT_AGENT, *, executor: bool = False
) -> KeyValue:
    """Create or update the streams and the consumer(s), and bind the runs bucket
    (creating it if absent); safe from every process at start-up, concurrently.

    Each consumer is provisioned by the processes that read it (``executor``: the
    step consumer, else the settle consumer), so an executor started with its own
    ``ack_wait_s`` is never reset by a gateway starting later, and vice versa."""
    # An executor's credential may create the streams, not change them (streams/auth.py).
    await ensure_stream(js, topo.stream_config(), update=not executor)
    await ensure_stream(js, topo.events_config(), update=not executor)
    consumer = topo.step_consumer_config() if executor else topo.settle_consumer_config()
    await patiently(f"consumer {consumer.durable_name}", js.add_consumer, topo.stream, consumer)
    return await ensure_bucket(js, topo.kv_config())

"""Subject names: the one place that spells them.

Request classes map to subjects of one work-queue stream; replies, cancels and
the NATS-native ingress have their own (core NATS) subject spaces.
"""

from __future__ import annotations

import zlib
from enum import StrEnum

PREFIX = "jetserve"


class RequestClass(StrEnum):
    """Request classes, each a subject (and a durable consumer) of the work-queue stream."""

    INTERACTIVE = "interactive"
    BATCH = "batch"
    EMBED = "embed"
    AGENT = "agent"  # model calls of agent runs (workers/agent), charged to the run


def request_subject(cls: RequestClass | str) -> str:
    return f"{PREFIX}.req.{RequestClass(cls).value}"


# The frames capture may be split into several streams (``Topology.frames_partitions``),
# each capturing one partition. The partition of a request is a stable hash of its
# id, computed by whoever builds its reply subject (a gateway, an agent executor)
# and carried there as a token right after the tenant's, so a tenant-scoped filter
# (``jetserve.reply.<tenant>.>``) stays tenant-scoped, workers need not know the
# count, and each stream selects its token without overlapping another. One
# partition (the default) keeps the subject without the token, as fleets before.


def frames_partition(request_id: str, partitions: int) -> int:
    """The frames partition of a request: crc32 of its id, the same in every process."""
    return zlib.crc32(request_id.encode()) % partitions if partitions > 1 else 0


def partition_token(partition: int) -> str:
    return f"p{partition}"


def _scope(tenant: str, request_id: str, partitions: int) -> str:
    """``<tenant>`` or ``<tenant>.p<N>``: the head of one request's reply subject."""
    if partitions <= 1:
        return tenant
    return f"{tenant}.{partition_token(frames_partition(request_id, partitions))}"


def _any_scope(partitions: int) -> str:
    return "*" if partitions <= 1 else "*.*"


def reply_subject(tenant: str, gateway_id: str, request_id: str, partitions: int = 1) -> str:
    """Where a worker sends frames for one request. The frames stream captures them
    for resumption; the tenant token makes a resume tenant-scoped by construction."""
    return f"{PREFIX}.reply.{_scope(tenant, request_id, partitions)}.{gateway_id}.{request_id}"


def reply_wildcard(gateway_id: str, partitions: int = 1) -> str:
    """One gateway's subscription for all its requests' frames."""
    return f"{PREFIX}.reply.{_any_scope(partitions)}.{gateway_id}.*"


def frames_capture_subject(partition: int, partitions: int) -> str:
    """What the capture stream of ``partition`` stores."""
    if partitions <= 1:
        return f"{PREFIX}.reply.>"
    return f"{PREFIX}.reply.*.{partition_token(partition)}.*.*"


# Token frames and heartbeats go live on a twin of the reply subject that the
# frames capture does not store; the capture keeps the reply subject itself, with
# tokens batched (workers/inference/relay.py): a quarter second a message.
LIVE = f"{PREFIX}.live"


def live_subject(reply: str) -> str:
    """The live twin of a reply subject (``jetserve.reply.X`` -> ``jetserve.live.X``)."""
    head = f"{PREFIX}.reply."
    return LIVE + "." + reply[len(head) :] if reply.startswith(head) else reply


def live_wildcard(gateway_id: str, partitions: int = 1) -> str:
    return f"{LIVE}.{_any_scope(partitions)}.{gateway_id}.*"


def live_filter(tenant: str, request_id: str, partitions: int = 1) -> str:
    return f"{LIVE}.{_scope(tenant, request_id, partitions)}.*.{request_id}"


def frames_filter(tenant: str, request_id: str, partitions: int = 1) -> str:
    """One request's captured frames, whichever gateway accepted it."""
    return f"{PREFIX}.reply.{_scope(tenant, request_id, partitions)}.*.{request_id}"


# The fleet-wide KV index (streams/kv_index.py): workers publish what their
# engines hold, gateways listen (core NATS). One subject for the fleet: an
# engine's cache serves every class.
KV_INDEX_SUBJECT = f"{PREFIX}.kvidx"


def resumed_subject(request_id: str) -> str:
    """A gateway announces here that a client resumed this request's stream."""
    return f"{PREFIX}.resumed.{request_id}"


# Classes whose requests may carry a prefix key: each also has lane subjects
# (``jetserve.req.<class>.lNN``), one durable consumer per lane, so requests that
# share a prefix share a lane and the replica that owns it (workers/inference/affinity.py).
LANE_CLASSES = (RequestClass.INTERACTIVE, RequestClass.BATCH)


def lane_subject(cls: RequestClass | str, lane: int) -> str:
    return f"{PREFIX}.req.{RequestClass(cls).value}.l{lane:02d}"


def lane_wildcard(cls: RequestClass | str) -> str:
    return f"{PREFIX}.req.{RequestClass(cls).value}.*"


# Classes whose gateways hold a flooding tenant's excess (gateway/inference/
# fair_gate.py): each also has ``jetserve.req.<class>.excess``, its own durable
# consumer, which workers serve only with the slots no in-turn request of the
# class waits for (workers/inference/admission.py), so a tenant that sends in
# turn is not queued behind another tenant's flood.
SHARE_CLASSES = (RequestClass.INTERACTIVE, RequestClass.BATCH, RequestClass.EMBED)


def excess_subject(cls: RequestClass | str) -> str:
    return f"{PREFIX}.req.{RequestClass(cls).value}.excess"


# Deployment pools (streams/pools.py): a request whose route names candidate
# deployments goes to ``jetserve.pool.<token>.<class>`` (or one of its lanes,
# ``...<class>.lNN``), pulled only by workers that serve that deployment.
POOL_SPACE = f"{PREFIX}.pool"
# Rollout events (core NATS, not stored: the route history is the record),
# e.g. the guard's automatic rollback (gateway/admin/rollout_guard.py).
ROLLOUT_EVENTS = f"{PREFIX}.rollout.events"


def pool_subject(token: str, cls: RequestClass | str) -> str:
    return f"{POOL_SPACE}.{token}.{RequestClass(cls).value}"


def pool_lane_subject(token: str, cls: RequestClass | str, lane: int) -> str:
    return f"{pool_subject(token, cls)}.l{lane:02d}"


def class_of(subject: str) -> str:
    """The request class of a work-queue subject (plain, lane, excess or pool)."""
    parts = subject.split(".")
    if subject.startswith(POOL_SPACE + ".") and len(parts) > 3:
        return parts[3]
    return parts[2] if len(parts) > 2 else subject


def pool_of(subject: str) -> str | None:
    """The pool token of a pool subject; None for the shared class subjects."""
    parts = subject.split(".")
    return parts[2] if subject.startswith(POOL_SPACE + ".") and len(parts) > 3 else None


def cancel_subject(request_id: str) -> str:
    return f"{PREFIX}.cancel.{request_id}"


# NATS-native ingress: a service sends an OpenAI-shaped body as a NATS request here
# (service API style) instead of calling the HTTP gateway.
INGRESS_CHAT = f"{PREFIX}.api.chat"
INGRESS_COMPLETIONS = f"{PREFIX}.api.completions"
INGRESS_EMBEDDINGS = f"{PREFIX}.api.embeddings"


def dlq_subject(source: str) -> str:
    """Where a message that could not be processed goes, by the subject it came on
    (``jetserve.req.batch`` -> ``jetserve.dlq.req.batch``)."""
    tail = source[len(PREFIX) + 1 :] if source.startswith(PREFIX + ".") else source
    return f"{PREFIX}.dlq.{tail}"


# Agent runs (streams.agent): step nudges and settlement requests on the
# JETSERVE_AGENT work queue, run events captured for resumable SSE, and core-NATS
# cancel notices that interrupt a step in flight.
AGENT_STEP = f"{PREFIX}.agent.step"
AGENT_SETTLE = f"{PREFIX}.agent.settle"
RUN_EVENTS_WILDCARD = f"{PREFIX}.run.*.*"
RUN_CANCEL_WILDCARD = f"{PREFIX}.agentctl.cancel.*"
INGRESS_RUNS = f"{PREFIX}.api.runs"  # .create | .get | .approve | .cancel (request/reply)


def run_events_subject(tenant: str, run_id: str) -> str:
    """One run's events; the tenant token makes a reader tenant-scoped by construction."""
    return f"{PREFIX}.run.{tenant}.{run_id}"


def run_cancel_subject(run_id: str) -> str:
    return f"{PREFIX}.agentctl.cancel.{run_id}"

"""Declarative JetStream definitions: the work-queue stream and one durable
pull consumer per request class. Provisioning (``streams.provision``) makes the
server match these; nothing else creates streams or consumers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from streams.rendezvous import DEFAULT_LOAD_FACTOR
from streams.routes import ROUTES_BUCKET, ROUTES_HISTORY
from streams.subjects import (
    LANE_CLASSES,
    POOL_SPACE,
    PREFIX,
    SHARE_CLASSES,
    RequestClass,
    excess_subject,
    frames_capture_subject,
    frames_partition,
    lane_subject,
    lane_wildcard,
    pool_lane_subject,
    request_subject,
)

# The priority group of lane consumers. Pull requests in it carry a priority
# (0 = highest); the server hands each message to the highest-priority waiting
# pull (``prioritized`` policy, nats-server >= 2.12).
PRIORITY_GROUP = "jetserve"
# The work-queue stream's metadata key of a class's lane count.
LANE_METADATA = "jetserve_lanes_"
POOL_LANES_METADATA = "jetserve_pool_lanes"
# Recorded by each stream of a fleet with one work-queue stream per class.
CLASS_STREAMS_METADATA = "jetserve_class_streams"
LANE_SHARDS_METADATA = "jetserve_lane_shards"
MAX_LANE_SHARDS = 8
LEGACY_LANES = 16
# ... and of the lane load factor (absent: the default, as before it was recorded).
LANE_LOAD_FACTOR_METADATA = "jetserve_lane_load_factor"
MAX_LANE_LOAD_FACTOR = 4.0
# ... and of the frames capture's partition count (absent: one stream, as before).
FRAMES_PARTITIONS_METADATA = "jetserve_frames_partitions"
# The most frames partitions: the credentials name every partition stream up to
# it (streams/auth.py), so they need no knowledge of a fleet's count.
MAX_FRAMES_PARTITIONS = 16


@dataclass(frozen=True)
class Limits:
    """Bounds of the work queue. A full queue refuses new work (discard new ->
    the ingress answers 429) rather than silently dropping old, accepted work."""

    max_msgs: int = 100_000
    max_bytes: int = 1 << 30
    max_msg_size: int = 4 << 20
    # Nats-Msg-Id dedupe: gateway retries and Idempotency-Key; at least the
    # gateway's idempotency window (GatewayConfig.idempotency_window_s).
    duplicate_window_s: float = 600.0
    max_age_s: float = 3600.0
    # Short ack_wait: a dead worker's message comes back quickly. Live workers
    # send in_progress() while waiting for the first token.
    ack_wait_s: float = 10.0
    # Failed attempts (an engine error before the first token) before a request
    # fails: the workers count them (streams.marks.FailureCounts).
    max_attempts: int = 5
    # Deliveries, a wider bound: a hand-back (a full worker naks, a lane
    # over-fetch, a drain) is a delivery but no failure; only a worker that
    # dies on the request every time exhausts these (then the dead-letter queue).
    max_deliver: int = 20
    max_waiting: int = 512  # concurrent pull requests per consumer
    # Consumers of the work-queue stream: 2 x 256 shared lanes, and 4 + 2 x 64
    # per deployment pool. nats-server 2.15 caps a stream at 1000 unless the
    # stream names a limit (and takes -1 as "its default"): ~60 pools fit here.
    max_consumers: int = 8192


@dataclass(frozen=True)
class FramesLimits:
    """The short-lived capture of every reply frame, for resumable streams.
    The bounds are each capture stream's: P partitions hold P times the bytes."""

    max_age_s: float = 600.0  # how long after a frame a client may still resume
    max_bytes: int = 512 << 20
    max_msg_size: int = 1 << 20

    def window_s(self, bytes_per_request: float, rps: float, partitions: int = 1) -> float:
        """How long a stream stays resumable at ``rps``: ``max_age_s`` unless the
        byte bounds of the ``partitions`` streams fill first (oldest out). The
        hash spreads requests evenly, so P streams hold P times the bytes."""
        held = self.max_bytes * partitions
        return min(self.max_age_s, held / max(bytes_per_request * rps, 1e-9))


def frames_stream_names(base: str, partitions: int) -> tuple[str, ...]:
    """The capture streams of ``partitions`` partitions: ``base`` alone for one."""
    if partitions <= 1:
        return (base,)
    return tuple(f"{base}_{n}" for n in range(partitions))


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
    # Prefix-affinity lanes per lane class (``class_lanes`` overrides one
    # class): at most this many replicas of a class own lanes. Each lane is a
    # durable consumer; a worker pulls only the lanes it ranks among the first
    # few (workers/inference/affinity.py), so more lanes cost little per worker.
    lanes: int = 256
    class_lanes: tuple[tuple[RequestClass, int], ...] = ()
    # Lanes per lane class in each deployment pool (streams/pools.py): a pool
    # holds a few of the fleet's replicas, so fewer lanes spread them.
    pool_lanes: int = 64
    # No worker owns more than this times its share of a class's lanes
    # (streams/rendezvous.py). Recorded with the lane counts: every worker and
    # gateway must compute the same owners, so none takes it from its own flags.
    lane_load_factor: float = DEFAULT_LOAD_FACTOR
    # One work-queue stream per request class (``<stream>_<CLASS>``), each with
    # its own leader and its own write rate, instead of ``stream`` for all:
    # one stream holds ~8k msgs/s (docs/scale.md, "several request streams").
    class_streams: bool = False
    # With ``class_streams``: each lane class's stream split in this many by
    # lane (lane ``n`` in shard ``n % lane_shards``; shard 0 also holds the
    # plain, excess and pool subjects), so one busy class is not one stream's
    # write rate either (docs/scale.md: interactive by hash of the lane).
    lane_shards: int = 1

    def stream_of(self, cls: RequestClass | str) -> str:
        """The work-queue stream that holds ``cls``'s plain, excess and pool
        subjects (with one shard: every subject of the class)."""
        if not self.class_streams:
            return self.stream
        return f"{self.stream}_{RequestClass(cls).value.upper()}"

    def shards_of(self, cls: RequestClass | str) -> int:
        if self.class_streams and RequestClass(cls) in self.lane_classes:
            return self.lane_shards
        return 1

    def stream_of_lane(self, cls: RequestClass | str, lane: int) -> str:
        """The stream of lane ``lane`` of ``cls`` (a shared or a pool's lane)."""
        shard = lane % self.shards_of(cls)
        return self.stream_of(cls) if shard == 0 else f"{self.stream_of(cls)}_{shard}"

    @property
    def request_streams(self) -> tuple[str, ...]:
        """Every work-queue stream (one, one per class, or per class and shard)."""
        names = (self.stream_of_lane(c, k) for c in self.classes for k in range(self.shards_of(c)))
        return tuple(dict.fromkeys(names))

    def stream_of_consumer(self, name: str) -> str:
        """The stream of a work-queue consumer, by its name."""
        cls, lane = self.consumer_class(name)
        if cls is None:
            raise ValueError(f"not a work-queue consumer: {name!r}")
        if lane:
            return self.stream_of_lane(cls, int(name.rsplit("-l", 1)[1]))
        return self.stream_of(cls)

    def split(self, class_streams: bool, lane_shards: int = 1) -> Topology:
        return replace(self, class_streams=class_streams, lane_shards=lane_shards)

    # Capture streams of the reply frames (1: ``frames_stream`` alone; P > 1:
    # ``<frames_stream>_0`` .. ``_P-1``, a request's by a hash of its id, named
    # in its reply subject: streams/subjects.py). Recorded in the work-queue
    # stream like the lanes, so every gateway and executor uses the fleet's.
    frames_partitions: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.lane_shards <= MAX_LANE_SHARDS:
            raise ValueError(f"lane_shards: 1..{MAX_LANE_SHARDS}, not {self.lane_shards}")
        if self.lane_shards > 1 and not self.class_streams:
            raise ValueError("lane shards split class streams: they need class_streams")
        if not 1 <= self.frames_partitions <= MAX_FRAMES_PARTITIONS:
            raise ValueError(
                f"frames_partitions: 1..{MAX_FRAMES_PARTITIONS}, not {self.frames_partitions}"
            )
        if not 1.0 <= self.lane_load_factor <= MAX_LANE_LOAD_FACTOR:
            raise ValueError(
                f"lane_load_factor: 1..{MAX_LANE_LOAD_FACTOR:g}, not {self.lane_load_factor}"
            )

    @property
    def frames_streams(self) -> tuple[str, ...]:
        """The capture streams, partition by partition."""
        return frames_stream_names(self.frames_stream, self.frames_partitions)

    def frames_stream_of(self, request_id: str) -> str:
        """The capture stream that holds ``request_id``'s frames."""
        return self.frames_streams[frames_partition(request_id, self.frames_partitions)]

    @property
    def lane_classes(self) -> tuple[RequestClass, ...]:
        return tuple(c for c in self.classes if c in LANE_CLASSES and self.lanes_of(c))

    def lanes_of(self, cls: RequestClass | str) -> int:
        """The lane count of ``cls`` (0: no lanes; only lane classes have any)."""
        if RequestClass(cls) not in LANE_CLASSES:
            return 0
        return dict(self.class_lanes).get(RequestClass(cls), self.lanes)

    def lane_metadata(self) -> dict[str, str]:
        """The lane counts and the frames partitions, as the stream records them:
        every gateway, worker and executor reads them there
        (:meth:`with_stream_lanes`), so none can disagree."""
        counts = {f"{LANE_METADATA}{c.value}": str(self.lanes_of(c)) for c in LANE_CLASSES}
        # Written when off too: an update keeps the keys it does not set
        # (streams/provision.py), so an absent key would not turn one off.
        split = {
            CLASS_STREAMS_METADATA: "1" if self.class_streams else "0",
            LANE_SHARDS_METADATA: str(self.lane_shards),
        }
        return {
            **counts,
            POOL_LANES_METADATA: str(self.pool_lanes),
            LANE_LOAD_FACTOR_METADATA: repr(self.lane_load_factor),
            FRAMES_PARTITIONS_METADATA: str(self.frames_partitions),
            **split,
        }

    def with_stream_lanes(self, metadata: dict[str, str] | None) -> Topology:
        """This topology with the lane counts and frames partitions the stream
        records (a stream provisioned before lanes were recorded had 16; before
        partitions were, one capture stream)."""
        found = metadata or {}
        counts = tuple(
            (c, int(found.get(f"{LANE_METADATA}{c.value}", LEGACY_LANES))) for c in LANE_CLASSES
        )
        pool_lanes = int(found.get(POOL_LANES_METADATA, self.pool_lanes))
        load_factor = float(found.get(LANE_LOAD_FACTOR_METADATA, DEFAULT_LOAD_FACTOR))
        partitions = int(found.get(FRAMES_PARTITIONS_METADATA, 1))
        split = found.get(CLASS_STREAMS_METADATA) == "1"
        return replace(
            self,
            class_lanes=counts,
            pool_lanes=pool_lanes,
            lane_load_factor=load_factor,
            frames_partitions=partitions,
            class_streams=split,
            lane_shards=int(found.get(LANE_SHARDS_METADATA, 1)) if split else 1,
        )

    @property
    def excess_classes(self) -> tuple[RequestClass, ...]:
        return tuple(c for c in self.classes if c in SHARE_CLASSES)

    def stream_config(self, name: str | None = None) -> StreamConfig:
        """The config of work-queue stream ``name`` (default: the one stream,
        or the first class's)."""
        name = name or self.request_streams[0]
        shards = [
            (c, k)
            for c in self.classes
            for k in range(self.shards_of(c))
            if self.stream_of_lane(c, k) == name
        ]
        if not shards:
            raise ValueError(f"not a work-queue stream of this topology: {name!r}")
        if self.class_streams:
            ((cls, shard),) = shards
            subjects = self._class_subjects(cls, shard)
        else:
            classes = [c for c, _ in shards]
            subjects = [request_subject(c) for c in classes]
            subjects += [lane_wildcard(c) for c in classes if c in self.lane_classes]
            subjects += [
                excess_subject(c)
                for c in classes
                if c in self.excess_classes and c not in self.lane_classes
            ]
            subjects.append(f"{POOL_SPACE}.>")  # deployment pools (streams/pools.py)
        lim = self.limits
        return StreamConfig(
            name=name,
            # Exactly the served class subjects: a publish to anything else fails
            # fast (no responders) instead of being stored and never consumed.
            # (The pools are one wildcard: a pool token nobody pulls is stored,
            # until max_age; only gateways and workers may publish there.)
            subjects=subjects,
            retention=RetentionPolicy.WORK_QUEUE,
            discard=DiscardPolicy.NEW,
            storage=StorageType.FILE,
            max_msgs=lim.max_msgs,
            max_bytes=lim.max_bytes,
            max_msg_size=lim.max_msg_size,
            max_age=lim.max_age_s,
            duplicate_window=lim.duplicate_window_s,
            max_consumers=lim.max_consumers,
            num_replicas=self.replicas,
            metadata=self.lane_metadata(),
        )

    def _class_subjects(self, cls: RequestClass, shard: int) -> list[str]:
        """Shard ``shard`` of ``cls``'s stream: its lanes (shared and every
        pool's), and in shard 0 the plain, excess and pool subjects."""
        n = self.shards_of(cls)
        if n == 1:
            out = [request_subject(cls), f"{POOL_SPACE}.*.{cls.value}"]
            if cls in self.lane_classes:
                out.append(lane_wildcard(cls))  # its lanes and its excess
            elif cls in self.excess_classes:
                out.append(excess_subject(cls))
            return [*out, f"{POOL_SPACE}.*.{cls.value}.*"]
        out = [request_subject(cls), excess_subject(cls)] if shard == 0 else []
        out += [f"{POOL_SPACE}.*.{cls.value}"] if shard == 0 else []
        out += [lane_subject(cls, n_) for n_ in range(shard, self.lanes_of(cls), n)]
        out += [pool_lane_subject("*", cls, n_) for n_ in range(shard, self.pool_lanes, n)]
        return out

    def frames_configs(self) -> list[StreamConfig]:
        """Every capture stream, partition by partition."""
        return [self.frames_config(n) for n in range(self.frames_partitions)]

    def frames_config(self, partition: int = 0) -> StreamConfig:
        lim = self.frames
        # Memory storage: frames are hot and short-lived; losing them on a server
        # restart only loses the ability to resume, never accepted work.
        return StreamConfig(
            name=self.frames_streams[partition],
            subjects=[frames_capture_subject(partition, self.frames_partitions)],
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

    def routes_config(self) -> KeyValueConfig:
        # Route contracts: key = route name, every put a revision; the history
        # is what `jetserve routes history|diff` reads.
        return KeyValueConfig(
            bucket=ROUTES_BUCKET,
            description="jetserve route contracts (written by the admin API only)",
            history=ROUTES_HISTORY,
            max_value_size=256 << 10,
            storage=StorageType.FILE,
            replicas=self.replicas,
        )

    def consumer_name(self, cls: RequestClass | str) -> str:
        return f"workers-{RequestClass(cls).value}"

    def lane_consumer_name(self, cls: RequestClass | str, lane: int) -> str:
        return f"workers-{RequestClass(cls).value}-l{lane:02d}"  # l00..l255

    def is_lane_consumer(self, name: str) -> bool:
        """A lane consumer's name, shared (``workers-<class>-lNN``) or a pool's
        (``pool-<token>-<class>-lNN``)."""
        _, lane = self.consumer_class(name)
        return lane

    def consumer_class(self, name: str) -> tuple[str | None, bool]:
        """(the class a work-queue consumer serves, whether it is a lane) by its
        name; (None, False) for a name that is none of ours."""
        head, _, tail = name.partition("-")
        if head not in ("workers", "pool") or not tail:
            return None, False
        parts = tail.split("-")
        lane = len(parts) > 1 and parts[-1][:1] == "l" and parts[-1][1:].isdigit()
        if lane or (head == "workers" and parts[-1] == "excess"):
            parts = parts[:-1]
        cls = parts[-1]
        if cls not in {c.value for c in self.classes} or (head == "workers" and len(parts) != 1):
            return None, False
        return cls, lane

    @property
    def lane_max_deliver(self) -> int:
        # An over-fetched message handed back (nak) counts as a delivery.
        return self.limits.max_deliver * 2

    def lane_consumer_config(self, cls: RequestClass, lane: int) -> dict[str, Any]:
        """Raw JetStream API config: nats-py's ConsumerConfig has no priority
        group fields, so lane consumers are created with this JSON directly."""
        lim = self.limits
        return {
            "durable_name": self.lane_consumer_name(cls, lane),
            "filter_subject": lane_subject(cls, lane),
            "ack_policy": "explicit",
            "ack_wait": int(lim.ack_wait_s * 1e9),
            "max_deliver": self.lane_max_deliver,
            "max_waiting": lim.max_waiting,
            "max_ack_pending": -1,
            "priority_groups": [PRIORITY_GROUP],
            "priority_policy": "prioritized",
        }

    def excess_consumer_name(self, cls: RequestClass | str) -> str:
        return f"workers-{RequestClass(cls).value}-excess"

    def consumer_names(self, cls: RequestClass | str) -> list[str]:
        """Every consumer that serves a class: the plain one, its lanes, its excess."""
        names = [self.consumer_name(cls)]
        if cls in self.lane_classes:
            names += [self.lane_consumer_name(cls, n) for n in range(self.lanes_of(cls))]
        if cls in self.excess_classes:
            names.append(self.excess_consumer_name(cls))
        return names

    def consumer_config(self, cls: RequestClass, *, excess: bool = False) -> ConsumerConfig:
        """The plain consumer of a class (``excess``: the one of its excess subject)."""
        lim = self.limits
        # Work-queue consumers must not overlap: one class subject each.
        return ConsumerConfig(
            durable_name=self.excess_consumer_name(cls) if excess else self.consumer_name(cls),
            filter_subject=excess_subject(cls) if excess else request_subject(cls),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=lim.ack_wait_s,
            max_deliver=lim.max_deliver,
            max_waiting=lim.max_waiting,
            max_ack_pending=-1,
        )


DEFAULT_TOPOLOGY = Topology()

"""Idempotent provisioning: the gateway (and the admin role) call ``ensure_topology``
at start-up; the first creates, the rest find what they need (or update it in
place). Workers and executors may not change the request path's streams (their
NATS credentials forbid it): they ``await_topology`` until it is there."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, KeyValueConfig, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from streams.definitions import DEFAULT_TOPOLOGY, Topology
from streams.depth import consumer_infos
from streams.errors import ProvisioningError
from streams.pools import pool_consumer_configs, pool_token
from streams.subjects import LANE_CLASSES

log = logging.getLogger(__name__)

CREATE_CONCURRENCY = 16
# nats-server answers JetStream API requests from a queue: behind a burst of
# consumer creations (each fsynced under sync_interval always) or while a
# cluster forms a stream's Raft group, an answer can take longer than the
# client's 5 s. Every provisioning call is idempotent, so it is asked again,
# for up to this long, before start-up fails.
PATIENCE_S = 60.0

T = TypeVar("T")
P = ParamSpec("P")


async def patiently(
    what: str, call: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
) -> T:
    """``call(*args, **kwargs)``, asked again while the server does not answer in time."""
    loop = asyncio.get_running_loop()
    end = loop.time() + PATIENCE_S
    while True:
        try:
            return await call(*args, **kwargs)
        except (nats.errors.TimeoutError, TimeoutError):
            if loop.time() >= end:
                raise
            log.warning("provisioning: no answer in time about %s; asking again", what)


# What a stream left as it is (``update=False``) is compared on.
_COMPARED = (
    "subjects", "retention", "storage", "discard", "max_age", "max_bytes",
    "max_msg_size", "duplicate_window", "num_replicas", "deny_delete",
)  # fmt: skip


async def _created(js: JetStreamContext, topo: Topology) -> bool:
    """Create ``topo``'s first work-queue stream if the fleet has none (in either
    layout); whether this call created it."""
    want = topo.stream_config(topo.request_streams[0])
    what = f"stream {want.name}"
    try:
        await recorded_stream(js, topo)
        return False
    except NotFoundError:
        pass
    try:
        await patiently(what, js.add_stream, want)
        return True
    except APIError as exc:
        # Lost the race (the other layout's winner makes this add overlap), or
        # refused: JetStream not ready yet (a cluster electing its leader). Only
        # a stream that is there now says which; without one, going on with this
        # process's own layout could rewrite the winner's a moment later.
        try:
            await recorded_stream(js, topo)
        except NotFoundError:
            raise ProvisioningError(f"cannot create {what}: {exc}") from exc
        return False


async def ensure_stream(js: JetStreamContext, want: StreamConfig, *, update: bool = True) -> None:
    """Create the stream, or update it in place (``update`` False: leave one that
    exists as it is: the caller's credential may create it, never change it,
    streams/auth.py); safe with concurrent callers."""
    name = want.name
    assert name is not None
    what = f"stream {name}"
    try:
        info = await patiently(what, js.stream_info, name)
    except NotFoundError:
        try:
            await patiently(what, js.add_stream, want)
            return
        except APIError as exc:  # a concurrent creator may have won the race
            try:
                info = await patiently(what, js.stream_info, name)
            except NotFoundError:
                raise ProvisioningError(f"cannot create stream {name}: {exc}") from exc
    if not update:
        differ = [
            f for f in _COMPARED
            if getattr(want, f) is not None and getattr(want, f) != getattr(info.config, f)
        ]  # fmt: skip
        if differ:
            # Left as it is (this credential may not change it), but said: a
            # deployment moved to 3 replicas kept its audit ledger at one, unseen.
            log.warning(
                "stream %s differs from this version's config in %s; an operator "
                "applies it with the admin credential",
                name,
                ", ".join(differ),
            )
        return
    try:
        await patiently(what, js.update_stream, _keeping_metadata(want, info.config))
    except APIError as exc:  # a change the server refuses (storage type, deny_delete)
        raise ProvisioningError(f"cannot update stream {name}: {exc}") from exc


def _keeping_metadata(want: StreamConfig, have: StreamConfig) -> StreamConfig:
    """``want`` with the metadata keys it does not set kept from ``have``: an update
    writes the stream's metadata whole, so a gateway of an older version (a rolling
    upgrade) stripped the keys a newer one had recorded. The server's own
    (``_nats.``) are the server's to set."""
    kept = {
        k: v for k, v in (have.metadata or {}).items() if not k.startswith("_nats.")
    }  # fmt: skip
    if not kept:
        return want
    return dataclasses.replace(want, metadata={**kept, **(want.metadata or {})})


async def ensure_bucket(js: JetStreamContext, want: KeyValueConfig) -> KeyValue:
    """Bind the key-value bucket ``want`` names, creating it if absent
    (concurrent-safe). One that exists is bound as it is; where its replicas,
    history or TTL differ from ``want`` (a migration to R3, another version's
    defaults), that is logged: it was bound in silence, and a fleet "moved to R3"
    kept every bucket at R1."""
    bucket, what = want.bucket, f"bucket {want.bucket}"
    try:
        kv = await patiently(what, js.key_value, bucket)
    except BucketNotFoundError:
        pass
    else:
        _differs(bucket, (await patiently(what, kv.status)).stream_info.config, want)
        return kv
    try:
        return await patiently(what, js.create_key_value, want)
    except (APIError, nats.errors.Error) as exc:  # a concurrent creator may have won
        try:
            return await patiently(what, js.key_value, bucket)
        except BucketNotFoundError:
            raise ProvisioningError(f"cannot create bucket {bucket}: {exc}") from exc


def _differs(bucket: str, have: StreamConfig, want: KeyValueConfig) -> None:
    """Log where a bound bucket's settings are not the ones asked for."""
    pairs = {
        "replicas": (have.num_replicas or 1, want.replicas or 1),
        "history": (have.max_msgs_per_subject, want.history),
        "ttl_s": (have.max_age or None, want.ttl or None),
    }
    for name, (is_, asked) in pairs.items():
        if is_ != asked:
            log.warning(
                "bucket %s has %s %s, not the %s asked for: bound as it is "
                "(change it with the nats CLI, or delete it to have it made anew)",
                bucket, name, is_, asked,
            )  # fmt: skip


async def ensure_routes(js: JetStreamContext, topo: Topology = DEFAULT_TOPOLOGY) -> KeyValue:
    """Bind the route-contract bucket, creating it if absent (concurrent-safe)."""
    return await ensure_bucket(js, topo.routes_config())


async def recorded_stream(js: JetStreamContext, topo: Topology) -> Any:
    """The info of the fleet's first work-queue stream, whichever layout it has
    (one stream, or one per class); NotFoundError when there is none yet."""
    for layout in (topo, topo.split(not topo.class_streams)):
        try:
            name = layout.request_streams[0]
            # Patiently, as every other provisioning call: a slow JetStream API at
            # start-up (a leader election) killed the process here.
            return await patiently(f"stream {name}", js.stream_info, name)
        except NotFoundError:
            continue
    raise NotFoundError(description=f"no {topo.stream} stream, in either layout")


async def recorded_lanes(js: JetStreamContext, topo: Topology) -> Topology:
    """``topo`` with the lane counts, frames partitions and stream layout an
    existing work-queue stream records: they win over any configured (a gateway
    configured otherwise would publish to lanes the workers do not pull, or resume
    from a capture stream its peers' requests are not in), and a difference is logged."""
    try:
        info = await recorded_stream(js, topo)
    except NotFoundError:
        return topo
    recorded = topo.with_stream_lanes(info.config.metadata)
    for cls in LANE_CLASSES:
        if recorded.lanes_of(cls) != topo.lanes_of(cls):
            log.warning(
                "%s records %d lanes for %s, not the configured %d: keeping the stream's "
                "(docs/routing.md, changing the lane count)",
                info.config.name,
                recorded.lanes_of(cls),
                cls.value,
                topo.lanes_of(cls),
            )
    if recorded.class_streams != topo.class_streams:
        log.warning(
            "the fleet has %s, not what this process was configured with: keeping the "
            "fleet's (docs/scale.md, several request streams)",
            "a work-queue stream per class" if recorded.class_streams else "one work-queue stream",
        )
    if recorded.lane_load_factor != topo.lane_load_factor:
        log.warning(
            "%s records lane load factor %g, not the configured %g: keeping the stream's "
            "(docs/routing.md, lane ownership)",
            info.config.name,
            recorded.lane_load_factor,
            topo.lane_load_factor,
        )
    if recorded.frames_partitions != topo.frames_partitions:
        log.warning(
            "%s records %d frames partitions, not the configured %d: keeping the stream's "
            "(docs/reliability.md, resuming a stream)",
            info.config.name,
            recorded.frames_partitions,
            topo.frames_partitions,
        )
    return recorded


def _current(info: ConsumerInfo | None, want: dict[str, Any]) -> bool:
    """Whether a lane consumer exists with the config ``want`` (raw JSON)."""
    if info is None:
        return False
    cfg = info.config
    return (
        cfg.filter_subject == want["filter_subject"]
        and cfg.max_deliver == want["max_deliver"]
        and cfg.max_waiting == want["max_waiting"]
        and cfg.ack_wait is not None
        and int(cfg.ack_wait * 1e9) == want["ack_wait"]
    )


async def ensure_topology(js: JetStreamContext, topo: Topology = DEFAULT_TOPOLOGY) -> Topology:
    """Create or update the request path's streams and consumers; returns the
    topology as provisioned (an existing stream's lane counts and layout kept)."""
    topo = await recorded_lanes(js, topo)
    if not await _created(js, topo):
        # Someone else made it since we looked (gateways starting together): its
        # lane counts, partitions and layout win, as for any stream found. Taken
        # from this process's own configuration instead, an update rewrote them,
        # and gateways configured with other frames partitions then made capture
        # streams whose subjects overlapped: every later start failed.
        topo = await recorded_lanes(js, topo)
    for name in topo.request_streams:
        await ensure_stream(js, topo.stream_config(name))
    for frames in topo.frames_configs():
        await ensure_stream(js, frames)
    await ensure_stream(js, topo.dlq_config())
    await ensure_routes(js, topo)
    for cls in topo.classes:
        # Creating a durable with a config is create-or-update on nats-server >= 2.10.
        plain = topo.consumer_config(cls)
        await patiently(f"{cls} consumer", js.add_consumer, topo.stream_of(cls), plain)
    for cls in topo.excess_classes:
        excess = topo.consumer_config(cls, excess=True)
        await patiently(f"{cls} excess", js.add_consumer, topo.stream_of(cls), excess)
    # Hundreds of lane consumers: create only those missing or changed, a few
    # requests at a time.
    wants = [
        topo.lane_consumer_config(cls, lane)
        for cls in topo.lane_classes
        for lane in range(topo.lanes_of(cls))
    ]
    for stream in topo.request_streams:
        mine = [w for w in wants if topo.stream_of_consumer(w["durable_name"]) == stream]
        if mine:
            infos = await patiently(f"{stream}'s consumers", consumer_infos, js, stream)
            have = {i.name: i for i in infos}
            await _create_missing(js, stream, mine, have)
    return topo


async def ensure_pool(js: JetStreamContext, topo: Topology, deployment: str) -> str:
    """Create the consumers of ``deployment``'s pool that are missing or changed
    (streams/pools.py); its pool token. ``topo`` as provisioned (pool lanes)."""
    token = pool_token(deployment)
    wants = pool_consumer_configs(topo, token)
    for stream in topo.request_streams:
        mine = [w for w in wants if topo.stream_of_consumer(w["durable_name"]) == stream]
        infos = await patiently(f"{stream}'s consumers", consumer_infos, js, stream)
        have = {i.name: i for i in infos}
        # Lanes first, the plain consumers after: a worker takes the plain ones'
        # presence as the pool's (workers/inference/pool_source.py).
        lanes = [w for w in mine if "priority_groups" in w]
        await _create_missing(js, stream, lanes, have)
        for plain in (w for w in mine if w not in lanes):  # in order: the last says "ready"
            await _create_missing(js, stream, [plain], have)
    return token


async def _create_missing(
    js: JetStreamContext,
    stream: str,
    wants: list[dict[str, Any]],
    have: dict[str, ConsumerInfo],
) -> None:
    """Create those of ``wants`` that ``have`` lacks or holds otherwise, a few
    requests at a time (hundreds of lanes)."""
    wants = [w for w in wants if not _current(have.get(w["durable_name"]), w)]
    gate = asyncio.Semaphore(CREATE_CONCURRENCY)

    async def create(want: dict[str, Any]) -> None:
        async with gate:
            await ensure_raw_consumer(js, stream, want)

    await asyncio.gather(*(create(w) for w in wants))


async def ensure_raw_consumer(js: JetStreamContext, stream: str, config: dict[str, Any]) -> None:
    """Create-or-update a durable from a raw JSON config (fields nats-py lacks)."""
    name = config["durable_name"]
    # The extended form names the filter too, so a role may be allowed to
    # create only consumers of some subjects (workers: their pool's).
    subject = f"{js._prefix}.CONSUMER.CREATE.{stream}.{name}.{config['filter_subject']}"
    payload = json.dumps({"stream_name": stream, "config": config}).encode()
    try:
        reply = await patiently(f"consumer {name}", js._nc.request, subject, payload, 5.0)
    except (nats.errors.Error, TimeoutError) as exc:
        raise ProvisioningError(f"cannot create consumer {name}: {exc}") from exc
    answer = json.loads(reply.data)
    if "error" in answer:
        raise ProvisioningError(f"cannot create consumer {name}: {answer['error']}")


async def await_topology(
    js: JetStreamContext,
    topo: Topology = DEFAULT_TOPOLOGY,
    within_s: float = 120.0,
    consumers: bool = True,
) -> Topology:
    """Until the work-queue stream (and with ``consumers`` every class consumer)
    exists (a gateway provisions them); a ProvisioningError after ``within_s``.
    Returns ``topo`` with the lane counts the stream records."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    pause = 0.05  # soon after a gateway that starts beside us, then every 0.5 s
    while True:
        try:
            info = await recorded_stream(js, topo)
            found = topo.with_stream_lanes(info.config.metadata)
            if not consumers:
                return found
            missing = set()
            names = {n for cls in found.classes for n in found.consumer_names(cls)}
            for stream in found.request_streams:
                mine = {n for n in names if found.stream_of_consumer(n) == stream}
                missing |= mine - {i.name for i in await consumer_infos(js, stream)}
            if not missing:
                return found
            raise NotFoundError(description=f"{len(missing)} consumers, e.g. {min(missing)}")
        except (NotFoundError, nats.errors.Error, TimeoutError) as exc:
            if loop.time() > end:
                raise ProvisioningError(
                    f"{topo.stream} or its consumers missing after {within_s:g}s "
                    f"(is a gateway running?): {exc}"
                ) from exc
            await asyncio.sleep(pause)
            pause = min(0.5, pause * 2)

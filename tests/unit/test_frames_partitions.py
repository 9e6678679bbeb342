"""The frames capture in several streams (streams/subjects.py, streams/definitions.py):
the subjects of one partition count, the stream filters that select them without
overlap, the count recorded in the work-queue stream, and the permissions that
name every partition stream. Through real NATS: tests/connected/test_frames_partitions.py."""

from __future__ import annotations

import pytest

from streams.auth import Role, permissions
from streams.definitions import (
    FRAMES_PARTITIONS_METADATA,
    MAX_FRAMES_PARTITIONS,
    FramesLimits,
    Topology,
)
from streams.subjects import (
    frames_capture_subject,
    frames_filter,
    frames_partition,
    live_filter,
    live_subject,
    live_wildcard,
    reply_subject,
    reply_wildcard,
)
from tests.unit.test_auth import _covers

IDS = [f"req_{n:04d}" for n in range(400)]


def test_one_partition_keeps_the_subjects_and_stream_of_fleets_before() -> None:
    topo = Topology()
    assert topo.frames_streams == ("JETSERVE_FRAMES",)
    assert topo.frames_stream_of("r1") == "JETSERVE_FRAMES"
    cfg = topo.frames_config()
    assert cfg.name == "JETSERVE_FRAMES"
    assert cfg.subjects == ["jetserve.reply.>"]
    assert reply_subject("acme", "gw1", "r1") == "jetserve.reply.acme.gw1.r1"
    assert reply_wildcard("gw1") == "jetserve.reply.*.gw1.*"
    assert live_wildcard("gw1") == "jetserve.live.*.gw1.*"
    assert live_filter("acme", "r1") == "jetserve.live.acme.*.r1"
    assert frames_filter("acme", "r1") == "jetserve.reply.acme.*.r1"


def test_the_partition_is_a_stable_hash_of_the_request_id_and_spreads() -> None:
    # crc32, not Python's salted hash(): every process agrees.
    assert frames_partition("req_0001", 4) == frames_partition("req_0001", 4)
    assert [frames_partition(i, 1) for i in IDS[:5]] == [0] * 5
    counts = [0] * 4
    for rid in IDS:
        counts[frames_partition(rid, 4)] += 1
    assert all(60 < c < 140 for c in counts), counts


def _matches(pattern: str, subject: str) -> bool:
    return _covers((pattern,), subject)


def test_each_partition_stream_captures_exactly_its_requests() -> None:
    topo = Topology(frames_partitions=4)
    assert topo.frames_streams == tuple(f"JETSERVE_FRAMES_{n}" for n in range(4))
    filters = [c.subjects or [] for c in topo.frames_configs()]
    assert [c.name for c in topo.frames_configs()] == list(topo.frames_streams)
    for rid in IDS:
        reply = reply_subject("acme", "gw1", rid, 4)
        p = frames_partition(rid, 4)
        assert reply == f"jetserve.reply.acme.p{p}.gw1.{rid}"
        holders = [n for n, f in enumerate(filters) if _matches(f[0], reply)]
        assert holders == [p], (rid, holders)
        assert topo.frames_stream_of(rid) == f"JETSERVE_FRAMES_{p}"
        # The gateway's subscriptions and the readers' filters find it; the live
        # twin keeps the token.
        assert _matches(reply_wildcard("gw1", 4), reply)
        assert _matches(live_wildcard("gw1", 4), live_subject(reply))
        assert _matches(live_filter("acme", rid, 4), live_subject(reply))
        assert _matches(frames_filter("acme", rid, 4), reply)
        # Another tenant's filter of the same id never does.
        assert not _matches(frames_filter("beta", rid, 4), reply)
        assert not _matches(live_filter("beta", rid, 4), live_subject(reply))
    # No two partition streams overlap (nats-server would refuse the second).
    for a in range(4):
        for b in range(4):
            if a != b:
                probe = frames_capture_subject(a, 4).replace("*", "x")
                assert not _matches(frames_capture_subject(b, 4), probe)


def test_the_work_queue_stream_records_the_partition_count() -> None:
    topo = Topology(frames_partitions=4)
    meta = topo.stream_config().metadata or {}
    assert meta[FRAMES_PARTITIONS_METADATA] == "4"
    # A gateway configured otherwise takes the stream's.
    assert Topology(frames_partitions=2).with_stream_lanes(meta).frames_partitions == 4
    # A stream provisioned before the count was recorded: one capture stream.
    legacy = {k: v for k, v in meta.items() if k != FRAMES_PARTITIONS_METADATA}
    assert Topology(frames_partitions=4).with_stream_lanes(legacy).frames_partitions == 1


def test_a_partition_count_out_of_range_is_refused() -> None:
    for bad in (0, MAX_FRAMES_PARTITIONS + 1):
        with pytest.raises(ValueError, match="frames_partitions"):
            Topology(frames_partitions=bad)


def test_the_resume_window_grows_with_the_partitions() -> None:
    limits = FramesLimits()
    per = 3_975.0  # bytes a 256-token streamed answer leaves in the capture (docs/scale.md)
    one = limits.window_s(per, 10_000)
    assert 12 < one < 15  # docs/scale.md: ~13 s at 10k req/s
    assert limits.window_s(per, 10_000, 8) == pytest.approx(8 * one)
    assert limits.window_s(per, 10, 8) == limits.max_age_s


def test_the_roles_reach_every_partition_stream_a_fleet_may_run() -> None:
    streams = ["JETSERVE_FRAMES"] + [f"JETSERVE_FRAMES_{n}" for n in range(MAX_FRAMES_PARTITIONS)]
    agent, gateway = permissions(Role.AGENT), permissions(Role.GATEWAY)
    worker, service = permissions(Role.WORKER), permissions(Role.SERVICE, "acme")
    for name in streams:
        assert _covers(agent.publish, f"$JS.API.CONSUMER.CREATE.{name}")
        assert _covers(agent.publish, f"$JS.API.STREAM.MSG.GET.{name}")
        assert _covers(gateway.publish, f"$JS.API.STREAM.CREATE.{name}")
        assert _covers(worker.publish, f"$JS.API.STREAM.INFO.{name}")
        assert not _covers(worker.publish, f"$JS.API.CONSUMER.CREATE.{name}")
        assert not _covers(gateway.publish, f"$JS.API.STREAM.DELETE.{name}")
        assert not _covers(service.publish, f"$JS.API.CONSUMER.CREATE.{name}")
    # A service reads no tenant's frames, partitioned or not.
    for subject in ("jetserve.reply.acme.p1.gw.r", "jetserve.live.acme.p1.gw.r"):
        assert not _covers(service.subscribe, subject)
    assert _covers(worker.publish, "jetserve.reply.acme.p3.gw.r")

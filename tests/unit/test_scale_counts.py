"""bench/scale_counts.py's arithmetic: which family a message on the bus belongs
to, the per-request figures net of the idle background, the mix's weighting,
membership's growth and the multiplication docs/scale.md shows."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_counts", ROOT / "bench/scale_counts.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scale_counts"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


ACK_REQ = "$JS.ACK.JETSERVE_REQ.workers-interactive-l07.1.5.5.1796.0"
ACK_POOL = "$JS.ACK.JETSERVE_REQ.pool-a1b2-interactive-l07.1.5.5.1796.0"
ACK_KV = "$JS.ACK.KV_jetserve_workers.vpF8XrWJ.1.19.17.1796.0"


@pytest.mark.parametrize(
    ("subject", "reply", "payload", "status", "want"),
    [
        ("jetserve.req.interactive.l07", "", b"{}", "", "publish req (lane)"),
        ("jetserve.req.embed", "", b"{}", "", "publish req (class subject)"),
        ("jetserve.req.batch.excess", "", b"{}", "", "publish req (excess)"),
        ("jetserve.pool.a1b2.interactive.l07", "", b"{}", "", "publish pool (lane)"),
        ("jetserve.pool.a1b2.batch", "", b"{}", "", "publish pool (class subject)"),
        # A delivery travels with its stream subject and an ack reply: not a publish.
        ("jetserve.req.interactive.l07", ACK_REQ, b"{}", "", "deliver workqueue"),
        ("jetserve.pool.a1b2.interactive.l07", ACK_POOL, b"{}", "", "deliver workqueue (pool)"),
        ("$KV.jetserve_workers.w1", "_INBOX.worker.x.y", b"dep", "", "kv-put membership"),
        ("$KV.jetserve_workers.w1", ACK_KV, b"dep", "", "deliver membership"),
        (
            "_INBOX.worker.x.y",
            "",
            b'{"stream":"KV_jetserve_workers","seq":3}',
            "",
            "puback membership -> worker",
        ),
        (
            "_INBOX.gateway.x.y",
            "",
            b'{"stream":"JETSERVE_REQ","seq":9}',
            "",
            "puback workqueue -> gateway",
        ),
        (
            "_INBOX.gateway.x",
            "",
            b'{"type":"io.nats.jetstream.api.v1.consumer_list_response","total":600}',
            "",
            "api-reply consumer_list_response -> gateway",
        ),
        ("_INBOX.worker.x", "", b"", "408", "status 408 -> worker"),
        ("_INBOX.worker.x", "", b"", "", "ack-confirm -> worker"),
        ("$JS.ACK.JETSERVE_REQ.workers-batch.1.2.3.4.0", "", b"+ACK", "", "ack workqueue"),
        ("$JS.ACK.JETSERVE_REQ.workers-batch.1.2.3.4.0", "", b"+WPI", "", "in-progress workqueue"),
        ("$JS.ACK.JETSERVE_REQ.workers-batch.1.2.3.4.0", "", b"-NAK", "", "nak workqueue"),
        (
            "$JS.API.CONSUMER.MSG.NEXT.JETSERVE_REQ.workers-embed",
            "_INBOX.w.1",
            b"{}",
            "",
            "pull workqueue",
        ),
        (
            "$JS.API.CONSUMER.LIST.JETSERVE_REQ",
            "_INBOX.g.1",
            b"{}",
            "",
            "api CONSUMER.LIST workqueue",
        ),
        (
            "$JS.API.STREAM.MSG.DELETE.JETSERVE_OUTBOX",
            "_INBOX.g.1",
            b"{}",
            "",
            "api STREAM.MSG.DELETE outbox",
        ),
        ("$JS.API.STREAM.INFO.JETSERVE_REQ", "_INBOX.g.1", b"", "", "api STREAM.INFO workqueue"),
        ("$JS.EVENT.ADVISORY.API", "", b"{}", "", "advisory"),
        (
            "jetserve.reply.demo.gw1.req1",
            "",
            b'{"type":"token","seq":1,"text":"a"}',
            "",
            "frame token",
        ),
        (
            "jetserve.reply.demo.gw1.req1",
            "",
            b'{"type":"heartbeat","seq":3}',
            "",
            "frame heartbeat",
        ),
        ("jetserve.ledger.demo", "", b"{}", "", "publish ledger"),
        ("jetserve.outbox.gw1", "", b"{}", "", "publish outbox"),
        ("jetserve.cancel.req1", "", b"{}", "", "publish cancel"),
    ],
)
def test_families(
    sc: ModuleType, subject: str, reply: str, payload: bytes, status: str, want: str
) -> None:
    assert sc.family(subject, reply, payload, status) == want


def test_doc_groups(sc: ModuleType) -> None:
    assert sc.doc_group("advisory") is None  # only there because the tap listens
    assert sc.doc_group("deliver workqueue (pool)") == "work queue: delivery to a worker"
    assert sc.doc_group("ack-confirm -> worker") == "work queue: ack + its confirmation"
    assert sc.doc_group("status 408 -> worker").startswith("work queue: pulls")
    assert sc.doc_group("deliver membership").startswith("membership")
    assert sc.doc_group("api-reply consumer_list_response -> gateway").startswith(
        "JS API: consumer list"
    )
    assert sc.doc_group("frame heartbeat") == "reply frames: heartbeats"
    assert sc.doc_group("puback outbox -> gateway").startswith("outbox")
    assert sc.doc_group("kv-put cancel-marks").startswith("cancels")


def test_per_request_nets_out_the_idle_background(sc: ModuleType) -> None:
    counts = {"frame token": (2500, 100_000), "kv-put membership": (25, 250)}
    idle = {"kv-put membership": (2.0, 20.0)}  # per second
    per = sc.per_request(counts, n=10, seconds=10.0, background=idle)
    assert per["frame token"] == {
        "msgs": 250.0,
        "bytes": 10_000.0,
        "raw_msgs": 250.0,
        "raw_bytes": 10_000.0,
    }
    # 25 puts, 20 of them the background's 2/s over 10 s: 0.5 per request.
    assert per["kv-put membership"]["msgs"] == 0.5
    assert per["kv-put membership"]["raw_msgs"] == 2.5
    # Never below zero: a quieter phase than the idle window counts 0.
    assert sc.per_request({"x": (1, 1)}, 1, 10.0, {"x": (5.0, 5.0)})["x"]["msgs"] == 0.0


def test_delta_and_rates(sc: ModuleType) -> None:
    before = {"a": (1, 10), "b": (5, 50)}
    after = {"a": (4, 40), "b": (5, 50), "c": (2, 2)}
    assert sc.delta(before, after) == {"a": (3, 30), "c": (2, 2)}
    assert sc.rates({"a": (4, 40)}, 2.0) == {"a": (2.0, 20.0)}


def test_mix_weights_each_kind_by_its_share(sc: ModuleType) -> None:
    per_kind = {
        "chat": {"frames": {"msgs": 252.0, "wire_bytes": 32_000.0}},
        "embed": {"frames": {"msgs": 2.0, "wire_bytes": 8_000.0}, "x": {"msgs": 4.0}},
    }
    mix = sc.mix_per_request(per_kind, {"chat": 0.75, "embed": 0.25})
    assert mix["frames"] == {"msgs": 189.5, "wire_bytes": 26_000.0}
    assert mix["x"] == {"msgs": 1.0}
    assert sc.at_rate(189.5, 10_000) == 1_895_000


def test_membership_is_quadratic(sc: ModuleType) -> None:
    assert sc.membership_rates(2, 1) == (2.0, 6.0)  # measured: ~8 messages/s with the puts
    assert sc.membership_rates(4, 2) == (4.0, 24.0)
    assert sc.membership_rates(500, 100) == (500.0, 300_000.0)


def test_redis_families(sc: ModuleType) -> None:
    shas = sc.script_names()
    reserve = next(sha for sha, name in shas.items() if name == "reserve")
    from gateway.tenancy.accounting_lua import RESERVE_LUA

    assert reserve == hashlib.sha1(RESERVE_LUA.encode()).hexdigest()
    args = ["EVALSHA", reserve, "21", "jetserve:acct:limits:org:o1", "x"]
    assert sc.redis_family(args, "tcp", shas) == "EVALSHA reserve jetserve:acct"
    assert sc.redis_family(["HINCRBY", "jetserve:acct:spend:x", "n", "1"], "lua", shas) == (
        "lua HINCRBY jetserve:acct"
    )
    assert sc.redis_family(["SET", "jetserve:idem:abc", "v"], "tcp", shas) == "SET jetserve:idem"
    assert sc.key_family("jetserve:hedge:interactive") == "jetserve:hedge"
    assert sc.commandstats({"cmdstat_get": {"calls": 3}, "other": 1}) == {"get": 3}


def test_replica_rate_follows_the_step_model(sc: ModuleType) -> None:
    from sim.profiles import PROFILES

    prof = PROFILES["h100-8b"]
    b, p, o = 128, 500, 250
    step = prof.step_time(b, b, b * (p + o // 2))
    want = 1.0 / (o * step / b + p * prof.token_compute_s)
    assert sc.replica_rate("h100-8b", b, p, o) == pytest.approx(want)
    # A longer prompt costs a replica more time.
    assert sc.replica_rate("h100-8b", b, 1000, o) < sc.replica_rate("h100-8b", b, p, o)


def test_wire_size(sc: ModuleType) -> None:
    # HMSG + subject + reply + sid/lengths + payload and the CRLFs.
    assert sc.wire_size("a.b", "r", 10) == 5 + 3 + 1 + 1 + 12 + 2 + 10 + 2

"""jetserve/bench/stages.py: a request's hops from its spans."""

from __future__ import annotations

from jetserve.bench.stages import SpanRecord, request_stages, stage_summary

MS = 1_000_000


def request(span_id: str, events: dict[str, int]) -> SpanRecord:
    return SpanRecord("jetserve.request", span_id, None, 0, 20 * MS, events)


def attempt(parent: str) -> SpanRecord:
    return SpanRecord(
        "jetserve.attempt", f"a-{parent}", parent, 4 * MS, 16 * MS,
        {"engine_call": 5 * MS, "engine_done": 15 * MS},
    )  # fmt: skip


def test_the_hops_are_differences_of_the_events_in_ms() -> None:
    full = {"held": 2 * MS, "queued": 4 * MS, "final": 17 * MS}
    rows = request_stages([request("r1", full), attempt("r1")])
    assert rows == [
        {
            "hold": 2.0, "queue_store": 2.0, "to_engine": 3.0, "engine": 10.0,
            "to_gateway": 2.0, "settle": 3.0, "total": 20.0,
        }
    ]  # fmt: skip
    summary = stage_summary(rows)
    assert summary["requests"] == 1
    assert summary["engine"] == {"p50": 10.0, "p90": 10.0}


def test_a_request_missing_a_hop_or_its_attempt_is_left_out() -> None:
    refused = request("r2", {"held": 2 * MS})  # no queue ack, no final
    lonely = request("r3", {"held": 1, "queued": 2, "final": 3})  # no attempt span
    assert request_stages([refused, attempt("r2"), lonely]) == []
    assert stage_summary([]) == {"requests": 0}

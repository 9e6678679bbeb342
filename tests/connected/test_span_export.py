"""Optional OpenTelemetry export: one span per gateway request and one per worker
attempt, in the client's trace, parented hop by hop, with no prompt text."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from jetserve.bench.stages import STAGES, read_spans, request_stages, stage_summary
from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected


def spans(fleet: Fleet) -> list[dict[str, object]]:
    out = []
    for path in sorted(fleet.workdir.glob("*.spans.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


async def test_spans_per_request_and_attempt_in_the_callers_trace(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(workers=1, export_spans=True)
    trace, caller_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions",
            json={
                "model": "sim-8b",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "a secret prompt"}],
            },
            headers={
                "Authorization": f"Bearer {fleet.api_key}",
                "traceparent": f"00-{trace}-{caller_span}-01",
            },
        )
        assert r.status_code == 200
        record = await c.get(f"{fleet.sim_url}/sim/requests/{r.headers['x-request-id']}")
    returned = r.headers["traceparent"].split("-")
    engine_tp = record.json()["traceparent"]
    fleet.stop(keep=True)  # flushes span exporters on shutdown (the teardown removes it)
    found = [s for s in spans(fleet) if s["trace_id"] == trace]
    request = next(s for s in found if s["name"] == "jetserve.request")
    attempt = next(s for s in found if s["name"] == "jetserve.attempt")
    assert request["parent_id"] == caller_span  # under the client's span
    assert request["span_id"] == returned[2]  # the id the client got back
    assert attempt["parent_id"] == request["span_id"]  # the worker hop under the gateway
    assert engine_tp.split("-")[2] == attempt["span_id"]  # the engine call under the attempt
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 5  # type: ignore[index]
    assert attempt["attributes"]["jetserve.attempt"] == 1  # type: ignore[index]
    # Timed, on the host's one clock: the worker's attempt inside the gateway's request.
    times = [request["start_ns"], attempt["start_ns"], attempt["end_ns"], request["end_ns"]]
    stamps = [t for t in times if isinstance(t, int)]
    assert len(stamps) == 4
    assert stamps == sorted(stamps)
    assert all("secret" not in json.dumps(s) for s in spans(fleet))


async def test_each_hop_of_an_answer_is_timed(make_fleet: Callable[..., Fleet]) -> None:
    # The hops jetserve bench embed --stages reports, on the real path: the hold,
    # the queue's ack, the worker's engine call, the frame back, the books.
    fleet = make_fleet(workers=1, export_spans=True)
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    async with httpx.AsyncClient(timeout=30) as c:
        for path, body in (
            ("/v1/embeddings", {"model": "sim-embed", "input": "where did the time go"}),
            ("/v1/chat/completions", {"model": "sim-8b", "max_tokens": 3,
                                      "messages": [{"role": "user", "content": "hi"}]}),
        ):  # fmt: skip
            r = await c.post(f"{fleet.base_url}{path}", json=body, headers=auth)
            assert r.status_code == 200, r.text
    fleet.stop(keep=True)  # flushes the span exporters (the teardown removes it)
    rows = request_stages(read_spans(sorted(fleet.workdir.glob("*.spans.jsonl"))))
    assert len(rows) == 2
    for row in rows:
        assert set(row) == set(STAGES)
        assert all(row[s] >= 0 for s in STAGES), row
        assert row["total"] >= row["hold"] + row["engine"] + row["settle"]
    assert stage_summary(rows)["requests"] == 2

"""Where a request's time went, hop by hop, from exported spans.

A fleet started with ``export_spans`` writes each process's finished spans as
JSON lines (``streams/tracing.py``), with start, end and the events of each hop
on the host's one clock. The gateway's ``jetserve.request`` span has ``held``
(the budget hold in Redis done), ``queued`` (the work queue acknowledged the
request) and ``final`` (the terminal frame arrived), and ends once the books
have it; the worker's ``jetserve.attempt`` span under it has ``engine_call``
and ``engine_done``. Joined by span id, each answered request gives:

- ``hold``: the request span's start to ``held``;
- ``queue_store``: ``held`` to ``queued`` (the publish, stored and acknowledged);
- ``to_engine``: ``held`` to the worker's ``engine_call`` (store, delivery, pull);
- ``engine``: ``engine_call`` to ``engine_done``;
- ``to_gateway``: ``engine_done`` to ``final``;
- ``settle``: ``final`` to the request span's end (the settlement's store);
- ``total``: the request span, start to end.

Exporting costs the processes a little CPU per span, so a run with it is a
little slower than one without: use it to see where the time goes, not for the
headline figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

STAGES = ("hold", "queue_store", "to_engine", "engine", "to_gateway", "settle", "total")


class SpanRecord(msgspec.Struct):
    name: str
    span_id: str
    parent_id: str | None = None
    start_ns: int | None = None
    end_ns: int | None = None
    events: dict[str, int] = {}


_DECODE = msgspec.json.Decoder(SpanRecord)


def read_spans(paths: Iterable[Path]) -> list[SpanRecord]:
    return [_DECODE.decode(line) for p in paths for line in p.read_bytes().splitlines() if line]


def request_stages(spans: Iterable[SpanRecord]) -> list[dict[str, float]]:
    """Each answered request's stages, in ms (requests missing a hop are left out)."""
    spans = list(spans)
    attempts = {s.parent_id: s for s in spans if s.name == "jetserve.attempt"}
    out = []
    for r in spans:
        a = attempts.get(r.span_id)
        if r.name != "jetserve.request" or a is None or r.start_ns is None or r.end_ns is None:
            continue
        try:
            held, queued, final = r.events["held"], r.events["queued"], r.events["final"]
            call, done = a.events["engine_call"], a.events["engine_done"]
        except KeyError:
            continue
        ns = {
            "hold": held - r.start_ns, "queue_store": queued - held, "to_engine": call - held,
            "engine": done - call, "to_gateway": final - done, "settle": r.end_ns - final,
            "total": r.end_ns - r.start_ns,
        }  # fmt: skip
        out.append({k: v / 1e6 for k, v in ns.items()})
    return out


def stage_summary(rows: list[dict[str, float]]) -> Mapping[str, Any]:
    """p50 and p90 of each stage, in ms, and how many requests."""
    out: dict[str, Any] = {"requests": len(rows)}
    for stage in STAGES:
        values = sorted(r[stage] for r in rows)
        if values:
            out[stage] = {
                "p50": round(statistics.median(values), 2),
                "p90": round(values[int(0.9 * (len(values) - 1))], 2),
            }
    return out

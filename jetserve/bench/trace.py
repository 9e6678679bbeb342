"""Trace replay: a JSONL file, one request a line.

    {"t": 0.0, "class": "interactive", "prefix_group": 3, "prefix_len": 512,
     "input_tokens": 900, "output_tokens": 128, "cancel_after_s": null}

`t` is the arrival time in seconds from the trace start (required, non-decreasing
after sorting); `input_tokens` and `output_tokens` are required; the rest are
optional (`class` defaults to `interactive`). `--save-trace` writes a generated
workload in the same format, so any run can be replayed exactly.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from jetserve.bench.arrivals import rescale
from jetserve.bench.workload import RequestSpec


class TraceLine(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    t: float
    input_tokens: int
    output_tokens: int
    cls: str = msgspec.field(default="interactive", name="class")
    prefix_group: int | None = None
    prefix_len: int = 0
    cancel_after_s: float | None = None


_decoder = msgspec.json.Decoder(TraceLine)
_encoder = msgspec.json.Encoder()


def parse_trace(text: str, *, source: str = "trace") -> list[RequestSpec]:
    lines: list[TraceLine] = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        try:
            line = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"{source}:{n}: {exc}") from None
        if line.t < 0 or line.input_tokens < 1 or line.output_tokens < 1:
            raise ValueError(f"{source}:{n}: t must be >= 0, token counts >= 1")
        lines.append(line)
    if not lines:
        raise ValueError(f"{source}: no requests")
    lines.sort(key=lambda x: x.t)
    t0 = lines[0].t
    return [
        RequestSpec(
            index=i,
            at=line.t - t0,
            cls=line.cls,
            input_tokens=max(
                line.input_tokens, line.prefix_len + 1 if line.prefix_group is not None else 1
            ),
            output_tokens=line.output_tokens,
            prefix_group=line.prefix_group,
            prefix_len=line.prefix_len if line.prefix_group is not None else 0,
            cancel_after=line.cancel_after_s,
        )
        for i, line in enumerate(lines)
    ]


def read_trace(path: str | Path) -> list[RequestSpec]:
    return parse_trace(Path(path).read_text(), source=str(path))


def dump_trace(reqs: list[RequestSpec]) -> str:
    out = []
    for r in reqs:
        line = TraceLine(
            t=round(r.at, 6),
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            cls=r.cls,
            prefix_group=r.prefix_group,
            prefix_len=r.prefix_len,
            cancel_after_s=None if r.cancel_after is None else round(r.cancel_after, 6),
        )
        out.append(_encoder.encode(line).decode())
    return "\n".join(out) + "\n"


def write_trace(path: str | Path, reqs: list[RequestSpec]) -> None:
    Path(path).write_text(dump_trace(reqs))


def at_rate(reqs: list[RequestSpec], rate: float) -> list[RequestSpec]:
    """The same requests, their arrival times rescaled to a mean rate (a sweep point)."""
    times = rescale([r.at for r in reqs], rate)
    return [msgspec.structs.replace(r, at=t) for r, t in zip(reqs, times, strict=True)]


def mean_rate(reqs: list[RequestSpec]) -> float:
    if len(reqs) < 2 or reqs[-1].at <= reqs[0].at:
        return 0.0
    return (len(reqs) - 1) / (reqs[-1].at - reqs[0].at)

"""The workload: who sends what, when. A schedule is a list of `RequestSpec`s built
deterministically from a seed, so every target of a run gets the same one.

Each aspect draws from its own seeded stream (arrivals, classes, lengths, prefixes,
cancellations), so changing one option leaves the others' draws as they were.
"""

from __future__ import annotations

import random

import msgspec

from jetserve.bench.arrivals import arrival_times
from jetserve.bench.dists import Dist, parse_dist


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    at: float  # seconds after the run start
    cls: str
    input_tokens: int
    output_tokens: int
    prefix_group: int | None = None  # requests of a group share their first prefix_len tokens
    prefix_len: int = 0
    cancel_after: float | None = None  # the client hangs up this long after sending


class ClassSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    weight: float
    input_len: Dist | None = None  # None: the workload's default
    output_len: Dist | None = None


class WorkloadSpec(msgspec.Struct, frozen=True, kw_only=True):
    classes: tuple[ClassSpec, ...] = (ClassSpec(name="interactive", weight=1.0),)
    input_len: Dist = Dist("fixed", 256)
    output_len: Dist = Dist("fixed", 128)
    prefix_groups: int = 0
    prefix_len: int = 0
    prefix_share: float = 0.0  # fraction of requests that belong to a prefix group
    cancel_rate: float = 0.0  # fraction of requests the client cancels
    cancel_after: Dist = Dist("uniform", 0.1, 1.0)  # seconds after sending
    burstiness: float = 1.0
    seed: int = 0

    def describe(self) -> dict[str, object]:
        return {
            "classes": {
                c.name: {
                    "weight": c.weight,
                    "input_len": (c.input_len or self.input_len).describe(),
                    "output_len": (c.output_len or self.output_len).describe(),
                }
                for c in self.classes
            },
            "prefix_groups": self.prefix_groups,
            "prefix_len": self.prefix_len,
            "prefix_share": self.prefix_share,
            "cancel_rate": self.cancel_rate,
            "cancel_after_s": self.cancel_after.describe(),
            "burstiness": self.burstiness,
            "seed": self.seed,
        }


def parse_class(text: str) -> ClassSpec:
    """`NAME=WEIGHT[,in=DIST][,out=DIST]`, e.g. `batch=0.2,in=2048,out=uniform:256:512`."""
    head, *opts = text.split(",")
    name, sep, weight = head.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"expected NAME=WEIGHT[,in=DIST][,out=DIST]: {text!r}")
    fields: dict[str, Dist] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key.strip() not in ("in", "out"):
            raise ValueError(f"unknown class option {opt!r} in {text!r} (in=, out=)")
        fields["input_len" if key.strip() == "in" else "output_len"] = parse_dist(value)
    w = float(weight)
    if w < 0:
        raise ValueError(f"class weight must be >= 0: {text!r}")
    return ClassSpec(name=name.strip(), weight=w, **fields)


def _rng(seed: int, aspect: str, salt: object = "") -> random.Random:
    # A string seed is hashed with SHA-512 by `random`: stable across runs and hosts.
    return random.Random(f"jetserve-bench:{seed}:{aspect}:{salt}")


def build_schedule(
    spec: WorkloadSpec, rate: float, *, duration: float | None = None, count: int | None = None
) -> list[RequestSpec]:
    times = arrival_times(
        _rng(spec.seed, "arrivals", f"{rate:g}"),
        rate,
        spec.burstiness,
        duration=duration,
        count=count,
    )
    return assign(spec, times)


def assign(spec: WorkloadSpec, times: list[float]) -> list[RequestSpec]:
    """Give each arrival a class, lengths, a prefix group and a cancellation."""
    total = sum(c.weight for c in spec.classes)
    if total <= 0:
        raise ValueError("class weights must add up to more than 0")
    r_cls = _rng(spec.seed, "class")
    r_len = _rng(spec.seed, "length")
    r_pfx = _rng(spec.seed, "prefix")
    r_cancel = _rng(spec.seed, "cancel")
    names = [c.name for c in spec.classes]
    weights = [c.weight for c in spec.classes]
    by_name = {c.name: c for c in spec.classes}
    out: list[RequestSpec] = []
    for i, at in enumerate(times):
        cls = by_name[r_cls.choices(names, weights)[0]]
        n_in = (cls.input_len or spec.input_len).sample_int(r_len)
        n_out = (cls.output_len or spec.output_len).sample_int(r_len)
        group: int | None = None
        plen = 0
        if spec.prefix_groups > 0 and spec.prefix_len > 0 and r_pfx.random() < spec.prefix_share:
            group = r_pfx.randrange(spec.prefix_groups)
            plen = spec.prefix_len
            n_in = max(n_in, plen + 1)  # the shared prefix is part of the prompt
        cancel: float | None = None
        if spec.cancel_rate > 0 and r_cancel.random() < spec.cancel_rate:
            cancel = max(0.0, spec.cancel_after.sample(r_cancel))
        out.append(
            RequestSpec(
                index=i,
                at=at,
                cls=cls.name,
                input_tokens=n_in,
                output_tokens=n_out,
                prefix_group=group,
                prefix_len=plen,
                cancel_after=cancel,
            )
        )
    return out

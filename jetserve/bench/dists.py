"""Length (and time) distributions for workloads: `fixed`, `uniform`, `normal`,
`lognormal`, written on the command line as `256`, `uniform:128:512`,
`normal:256:64` or `lognormal:256:0.5` (median, sigma)."""

from __future__ import annotations

import math
import random
from typing import Literal

import msgspec

Kind = Literal["fixed", "uniform", "normal", "lognormal"]


class Dist(msgspec.Struct, frozen=True):
    kind: Kind
    a: float  # fixed value, low, mean, or median
    b: float = 0.0  # high, standard deviation, or sigma

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "normal":
            return rng.gauss(self.a, self.b)
        return self.a * math.exp(rng.gauss(0.0, self.b))

    def sample_int(self, rng: random.Random, lo: int = 1) -> int:
        """Rounded and clipped at `lo`: token counts are positive integers."""
        return max(lo, round(self.sample(rng)))

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "normal":
            return self.a
        return self.a * math.exp(self.b * self.b / 2)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_dist(text: str) -> Dist:
    head, _, rest = text.strip().partition(":")
    try:
        if not rest:
            return _checked(Dist("fixed", float(head)))
        args = [float(x) for x in rest.split(":")]
    except ValueError:
        raise ValueError(f"not a distribution: {text!r}") from None
    if head not in ("uniform", "normal", "lognormal") or len(args) != 2:
        raise ValueError(
            f"not a distribution: {text!r} "
            "(N, uniform:LO:HI, normal:MEAN:SD, lognormal:MEDIAN:SIGMA)"
        )
    return _checked(Dist(head, args[0], args[1]))  # type: ignore[arg-type]


def _checked(d: Dist) -> Dist:
    if d.a < 0 or d.b < 0 or (d.kind == "uniform" and d.b < d.a):
        raise ValueError(f"bad distribution parameters: {d.describe()}")
    return d

"""Open-loop arrival times: Poisson, or gamma with a burstiness factor.

As vLLM's `benchmark_serving --burstiness`: inter-arrival gaps are gamma distributed
with shape = burstiness and scale = 1 / (rate * burstiness), so the mean rate is
`rate` whatever the burstiness; burstiness 1 is a Poisson process, < 1 is burstier,
> 1 is more regular.
"""

from __future__ import annotations

import random


def gap(rng: random.Random, rate: float, burstiness: float) -> float:
    if burstiness == 1.0:
        return rng.expovariate(rate)
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_times(
    rng: random.Random,
    rate: float,
    burstiness: float = 1.0,
    *,
    duration: float | None = None,
    count: int | None = None,
) -> list[float]:
    """Offsets from the run start (the first request at 0), until `duration` seconds
    or `count` requests, whichever is given (count wins)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if duration is None and count is None:
        raise ValueError("give a duration or a count")
    times: list[float] = []
    t = 0.0
    while True:
        if count is not None:
            if len(times) >= count:
                break
        elif duration is not None and t >= duration:
            break
        times.append(t)
        t += gap(rng, rate, burstiness)
    return times


def rescale(times: list[float], rate: float) -> list[float]:
    """Stretch or squeeze a recorded arrival sequence to a mean rate, keeping its shape."""
    if len(times) < 2:
        return list(times)
    t0 = times[0]
    span = times[-1] - t0
    if span <= 0:
        return [0.0 for _ in times]
    factor = ((len(times) - 1) / rate) / span
    return [(t - t0) * factor for t in times]

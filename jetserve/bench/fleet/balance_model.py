"""A model of lane balance without a fleet: the ``scale`` trace over the lane
assignment and a run-time balance rule, in pure Python, in well under a second.

It replays what the fleet does with each request of a shared-prefix trace:

- the gateway hashes its prefix group to one of ``lanes`` lanes;
- the lane's owner and backups (streams/rendezvous.py, ``depth`` of them) each
  have a pull waiting, at the priority the rule gives them now; the server
  hands the request to the highest (lowest number), the first in rendezvous
  order on a tie;
- each replica's start rate is a decaying average (workers/inference/affinity.py
  ``StartRate``); the others hear it once a beat, as through the members bucket;
- each replica's prefix cache holds ``cache_groups`` prefixes, least recently
  used out; the oracle's holds every prefix ever seen.

What it leaves out: saturation (at the bench's load no replica is ever full,
so every candidate always has a pull waiting) and pulls standing at an old
priority (the worker withdraws them when its tier changes). It is what chose
streams/balance.py's rule, and tests/unit/test_balance_model.py keeps it
choosing so.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from streams.balance import BALANCE, RATE_TAU_S, BalanceRule
from streams.rendezvous import DEFAULT_DEPTH, DEFAULT_LOAD_FACTOR, assign

# (rank among the lane's pullers, this replica's rate, the pool's mean rate)
# -> the pull's priority.
Rule = Callable[[int, float, float], int]


def old_rule(depth: int = DEFAULT_DEPTH) -> Rule:
    """The rule of before: a hot owner (> 1.25 x mean + 0.5 req/s) lets its
    backups go first; backups keep their rank whatever their load."""

    def rule(rank: int, mine: float, mean: float) -> int:
        if rank == 0 and mine > 1.25 * mean + 0.5:
            return depth
        return rank

    return rule


def tier_rule(balance: BalanceRule = BALANCE) -> Rule:
    """streams/balance.py's tiers."""
    return balance.priority


def affinity_only(rank: int, mine: float, mean: float) -> int:
    """No run-time balance: every lane to its owner."""
    return rank


@dataclass(frozen=True)
class Outcome:
    requests: int
    busiest_over_mean: float
    serving: int
    replicas: int
    hit_share_of_oracle: float  # requests served warm, over the oracle's
    groups_split: float  # replicas serving a group, averaged over requests


def zipf_weights(groups: int, s: float = 0.6) -> list[float]:
    return [1 / (g + 1) ** s for g in range(groups)]


def bench_members(replicas: int = 64, per_worker: int = 8) -> list[str]:
    """The scale bench's member ids: ``replicas - 1`` engines, ``per_worker`` to
    a worker process (``worker<n>-bench-<k>``), and one single-engine worker."""
    engines = replicas - 1
    out = []
    for n in range(0, engines, per_worker):
        here = min(per_worker, engines - n)
        base = f"worker{n // per_worker}-bench"
        out += [base] if here == 1 else [f"{base}-{k}" for k in range(here)]
    out.append(f"worker{math.ceil(engines / per_worker)}-bench")
    return out


def simulate(
    rule: Rule,
    members: Sequence[str],
    rate: float,
    duration: float,
    seed: int = 0,
    groups: int = 256,
    lanes: int = 256,
    depth: int = DEFAULT_DEPTH,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    tau_s: float = RATE_TAU_S,
    beat_s: float = 1.0,
    cache_groups: int = 48,
    s: float = 0.6,
    warmup: float = 0.0,
) -> Outcome:
    rng = random.Random(seed)
    order = assign(members, lanes, depth, load_factor)
    names = list(order.members)
    index = {m: i for i, m in enumerate(names)}
    lane_of = [
        int.from_bytes(hashlib.blake2b(f"{seed}\0{g}".encode(), digest_size=8).digest()) % lanes
        for g in range(groups)
    ]
    weights = zipf_weights(groups, s)
    n = len(names)
    est = [0.0] * n  # each replica's decaying start rate, as of est_at
    est_at = [0.0] * n
    heard = [0.0] * n  # as the others last heard it
    next_beat = beat_s
    served = [0] * n
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
    seen: set[int] = set()
    hits = oracle_hits = 0
    on: dict[int, set[int]] = {}  # group -> replicas that served it
    split = 0
    t, count = 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= warmup + duration:
            break
        while next_beat <= t:
            for i in range(n):
                heard[i] = est[i] * math.exp(-(next_beat - est_at[i]) / tau_s)
            next_beat += beat_s
        g = rng.choices(range(groups), weights)[0]
        pullers = [index[m] for m in order.orders[lane_of[g]]]
        total = sum(heard)
        best: tuple[int, int] | None = None
        for rank, i in enumerate(pullers):
            mine = est[i] * math.exp(-(t - est_at[i]) / tau_s)
            mean = (total - heard[i] + mine) / n
            p = rule(rank, mine, mean)
            if best is None or p < best[0]:
                best = (p, i)
        assert best is not None
        i = best[1]
        est[i] = est[i] * math.exp(-(t - est_at[i]) / tau_s) + 1.0 / tau_s
        est_at[i] = t
        counted = t >= warmup
        served[i] += counted
        count += counted
        cache = caches[i]
        if g in cache:
            hits += counted
            cache.move_to_end(g)
        else:
            cache[g] = None
            if len(cache) > cache_groups:
                cache.popitem(last=False)
        if g in seen:
            oracle_hits += counted
        seen.add(g)
        on.setdefault(g, set()).add(i)
        split += len(on[g]) if counted else 0
    mean_served = count / n
    return Outcome(
        requests=count,
        busiest_over_mean=round(max(served) / mean_served, 2) if count else 0.0,
        serving=sum(1 for c in served if c),
        replicas=n,
        hit_share_of_oracle=round(hits / oracle_hits, 3) if oracle_hits else 1.0,
        groups_split=round(split / max(count, 1), 2),
    )

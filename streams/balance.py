"""Bounded load at run time: which of a lane's owner and backups goes first.

Lane ownership (streams/rendezvous.py) bounds how many lanes a replica owns,
not how busy they are: with a Zipf-like prefix popularity one lane can carry
several times a replica's mean load. So each replica sorts itself into a tier
by its start rate against its pool's mean, and a lane's pulls go first to the
lowest tier among its owner and backups:

- **cold** (under ``cold_factor`` x the mean, less the estimate's noise):
  first on every lane it pulls, so a replica that owns only unpopular lanes
  still serves, taking load off the owners it backs;
- **normal**: the owner first, then the backups in rendezvous order (the
  prefix stays where its KV blocks are);
- **hot** (over ``hot_factor`` x the mean, plus the estimate's noise): last on
  every lane it pulls, owned or backed, the hottest last of all (in steps of
  ``HOT_STEP`` over the line). A hot prefix warms a backup; a backup that
  took it and got hot in turn passes it on, and a lane whose pullers are all
  hot goes to the least hot of them.

Tiers wait for evidence: while the pool's mean replica has started fewer
than ``min_starts`` requests within the estimate's window (``mean * tau``),
every replica is normal. A few requests tell nothing of a replica's share,
and spreading on them only costs cache misses (a 4-replica fleet that has
served 32 requests sent them back and forth between owner and backup).

The slack is the noise of the rate estimate, not a fixed rate: a decaying
average over ``tau_s`` seconds of a Poisson stream of r requests/s has a
standard deviation of sqrt(r / (2 tau)), so one of those keeps a replica at
its mean from flapping, at 0.2 req/s per replica as at 20. (The fixed
0.5 req/s of before let nothing spill below ~3.4x the mean at 0.23 req/s per
replica.) jetserve/bench/fleet/balance_model.py chose these numbers
(docs/routing.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

RATE_TAU_S = 60.0  # a replica's start rate: a decaying average over this long
HOT_STEP = 0.1  # hot levels: each 10 % further over the hot line
RANKS = 3  # priorities per cold/normal tier: owner, first backup, the rest
HOT_LEVELS = 4  # 10 priorities in all (the server's 0..9): 3 + 3 + 4
HOT_PRIORITY = 2 * RANKS  # a hot worker's pulls: this or later


class Tier(IntEnum):
    COLD = 0
    NORMAL = 1
    HOT = 2


@dataclass(frozen=True)
class BalanceRule:
    hot_factor: float = 1.2
    cold_factor: float = 0.3
    sigmas: float = 1.0  # the slack, in standard deviations of the estimate
    tau_s: float = RATE_TAU_S
    min_starts: float = 10.0  # the pool's mean starts within tau before tiers apply

    def noise(self, mean: float) -> float:
        """The rate estimate's standard deviation at ``mean`` requests/s."""
        return math.sqrt(max(mean, 0.0) / (2 * self.tau_s))

    def hot_line(self, mean: float) -> float:
        return self.hot_factor * mean + self.sigmas * self.noise(mean)

    def tier(self, mine: float, mean: float) -> Tier:
        """This replica's tier, its start rate ``mine`` against its pool's ``mean``."""
        if mean * self.tau_s < self.min_starts:
            return Tier.NORMAL  # too few starts yet to tell a share from noise
        if mine > self.hot_line(mean):
            return Tier.HOT
        if mine < self.cold_factor * mean - self.sigmas * self.noise(mean):
            return Tier.COLD
        return Tier.NORMAL

    def priority(self, rank: int, mine: float, mean: float) -> int:
        """The pull priority (0 first, 9 last) of the lane's ``rank``-th puller
        (0: the owner) that starts ``mine`` requests/s in a pool whose mean is ``mean``."""
        tier = self.tier(mine, mean)
        if tier is Tier.HOT:
            level = int((mine / self.hot_line(mean) - 1.0) / HOT_STEP)
            return HOT_PRIORITY + min(level, HOT_LEVELS - 1)
        return int(tier) * RANKS + min(rank, RANKS - 1)


BALANCE = BalanceRule()

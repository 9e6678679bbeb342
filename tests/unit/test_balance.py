"""The run-time balance rule (streams/balance.py): tiers by start rate against
the pool's mean, with the rate estimate's noise as the slack."""

from __future__ import annotations

import math

from streams.balance import BALANCE, HOT_PRIORITY, RANKS, BalanceRule, Tier

MEAN = 0.234  # 15 req/s over 64 replicas: the scale bench's


def test_the_slack_is_the_estimates_noise_not_a_fixed_rate() -> None:
    rule = BalanceRule(hot_factor=1.2, cold_factor=0.3, sigmas=1.0, tau_s=60.0)
    assert math.isclose(rule.noise(MEAN), math.sqrt(MEAN / 120))
    line = rule.hot_line(MEAN)
    # At 0.23 req/s per replica, hot starts under 1.5x the mean (the fixed
    # 0.5 req/s of before put it at ~3.4x).
    assert 1.2 * MEAN < line < 1.5 * MEAN
    assert rule.tier(line * 1.01, MEAN) is Tier.HOT
    assert rule.tier(line * 0.99, MEAN) is Tier.NORMAL
    # The same factors hold at 100x the load, the noise shrinking relative to it.
    assert rule.tier(1.3 * 23.4, 23.4) is Tier.HOT
    assert rule.tier(0.25 * 23.4, 23.4) is Tier.COLD
    assert rule.tier(0.25 * MEAN, MEAN) is Tier.NORMAL  # within the noise at 0.23
    assert rule.tier(0.0, MEAN) is Tier.COLD
    assert rule.tier(5.0, 0.0) is Tier.NORMAL  # an idle pool: nothing to balance


def test_tiers_wait_for_enough_starts() -> None:
    rule = BalanceRule(tau_s=60.0, min_starts=10.0)
    # A pool whose mean replica started 8 requests in the last minute: one
    # that started 20 is not hot yet, one that started none not cold.
    assert rule.tier(20 / 60, 8 / 60) is Tier.NORMAL
    assert rule.tier(0.0, 8 / 60) is Tier.NORMAL
    # At 12 it is evidence.
    assert rule.tier(30 / 60, 12 / 60) is Tier.HOT
    assert rule.tier(0.0, 12 / 60) is Tier.COLD


def test_tiers_come_before_ranks() -> None:
    cold, normal, hot = 0.0, MEAN, 3 * MEAN
    # Normal: the owner first, then the backups in order; ranks past the
    # second backup tie.
    assert [BALANCE.priority(r, normal, MEAN) for r in range(5)] == [3, 4, 5, 5, 5]
    # A cold backup goes before a normal owner; a hot owner after any backup.
    assert BALANCE.priority(3, cold, MEAN) < BALANCE.priority(0, normal, MEAN)
    assert BALANCE.priority(0, hot, MEAN) > BALANCE.priority(RANKS, normal, MEAN)
    # Within hot, the rank does not count: the least hot goes first.
    assert BALANCE.priority(0, hot, MEAN) == BALANCE.priority(3, hot, MEAN)
    line = BALANCE.hot_line(MEAN)
    levels = [BALANCE.priority(0, line * f, MEAN) for f in (1.05, 1.15, 1.25, 1.35, 9.0)]
    assert levels == [HOT_PRIORITY, HOT_PRIORITY + 1, HOT_PRIORITY + 2, 9, 9]
    # Every priority is one the server takes.
    for mine in (0.0, MEAN, line * 1.05, 100.0):
        for rank in range(8):
            assert 0 <= BALANCE.priority(rank, mine, MEAN) <= 9

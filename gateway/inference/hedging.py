"""Hedging: when a request's first token is late, a second copy races it.

The delay is the class's observed p95 first-token delay (or the route's fixed
seconds); the first copy to emit a token wins and the other is cancelled
(``Cancel.keep_attempt``). Extra attempts are capped per class by a budget
that each request grows by ``max_extra_ratio`` — so at most that share of
requests ever pays for a second attempt, bursts included. With Redis (every
gateway process), the budget is the fleet's, shared by every replica
(``hedge_budget.py``); without, this process's own.
"""

from __future__ import annotations

from collections import deque

from gateway.inference.hedge_budget import SharedHedgeBudget
from streams.routes import HedgePolicy

WINDOW = 512  # recent first-token delays per class
BUDGET_CAP = 10.0  # hedges a quiet spell can bank for the next burst


class Hedger:
    def __init__(self, shared: SharedHedgeBudget | None = None) -> None:
        self._delays: dict[str, deque[float]] = {}
        self._budget: dict[str, float] = {}  # without a shared budget
        self._shared = shared
        self.sent = 0

    def observe(self, cls: str, first_token_s: float) -> None:
        self._delays.setdefault(cls, deque(maxlen=WINDOW)).append(first_token_s)

    def quantile(self, cls: str, q: float) -> tuple[float, int]:
        """The q-quantile of recent first-token delays, and how many there are."""
        window = sorted(self._delays.get(cls, ()))
        if not window:
            return 0.0, 0
        return window[int(q * (len(window) - 1))], len(window)

    def delay(self, cls: str, policy: HedgePolicy) -> float | None:
        """Seconds to wait before hedging this request, or None: don't."""
        if not policy.enabled:
            return None
        if not isinstance(policy.delay, str):
            return policy.delay
        p95, samples = self.quantile(cls, 0.95)
        return p95 if samples >= policy.min_samples and p95 > 0 else None

    def admit(self, cls: str, policy: HedgePolicy) -> None:
        """Every hedge-eligible request grows its bank's hedge budget (``cls``: its
        class, or its route within it: dispatch.hedge_bank)."""
        if not policy.enabled:
            return
        if self._shared is not None:
            self._shared.earn(cls, policy.max_extra_ratio)
            return
        budget = self._budget.get(cls, 0.0) + policy.max_extra_ratio
        self._budget[cls] = min(budget, BUDGET_CAP)

    async def take(self, cls: str) -> bool:
        """Spend one extra attempt, if the budget holds one."""
        if self._shared is not None:
            if not await self._shared.take(cls):
                return False
        elif self._budget.get(cls, 0.0) < 1.0:
            return False
        else:
            self._budget[cls] -= 1.0
        self.sent += 1
        return True

"""The vocabulary of accounting: who pays (:class:`Scope`), at which level, what
each level may spend and how fast (:class:`LimitSpec`), and what a request holds
(:class:`Reservation`). The accountant that enforces them is
gateway/tenancy/accounting.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, get_args

from gateway.tenancy.keys import KeyRecord

Level = Literal["org", "tenant", "key"]
Period = Literal["day", "month", "total"]
LimitKind = Literal["rpm", "tpm"]

LEVELS: tuple[Level, ...] = ("org", "tenant", "key")
PERIODS: tuple[Period, ...] = ("day", "month", "total")
KINDS: tuple[LimitKind, ...] = ("rpm", "tpm")


@dataclass(frozen=True, slots=True)
class Scope:
    org: str
    tenant: str
    key_id: str

    @classmethod
    def of(cls, key: KeyRecord) -> Scope:
        """The payer of a key's requests: a tenant outside any org is its own org."""
        return cls(key.org or key.tenant, key.tenant, key.key_id)

    def ident(self, level: Level) -> str:
        return {"org": self.org, "tenant": self.tenant, "key": self.key_id}[level]


# The operator tenant. Shadow copies of a rollout (gateway/inference/shadow.py) run
# as it and are charged to it, at every level (its own org and key), so its budget
# is the operator's shadow budget. It is built in: its limits are set like any
# tenant's without a tenant record, and no tenant may be created with its id.
# The most one hold may be, in micro-USD (1 million USD): the reserve script adds
# each to the org's, tenant's and key's counters, 64-bit integers in Redis.
MAX_AMOUNT_MICROS = 10**12
SHADOW_TENANT = "jetserve-shadow"
SHADOW_SCOPE = Scope(SHADOW_TENANT, SHADOW_TENANT, SHADOW_TENANT)


MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """Limits of one org, tenant or key. ``None`` means unlimited.

    ``budget_micros`` applies per ``period`` (UTC day, UTC month, or for all time);
    ``rpm`` / ``tpm`` are requests and worst-case tokens per minute (GCRA, see
    gateway/tenancy/accounting.py for the burst). ``weight`` (a tenant's; ``None``:
    1) is its share of a busy class against other tenants' (gateway/inference/
    fair_gate.py): weight 2 gets two turns for another's one.
    """

    budget_micros: int | None = None
    period: Period = "month"
    rpm: int | None = None
    tpm: int | None = None
    weight: float | None = None

    def __post_init__(self) -> None:
        if self.period not in PERIODS:
            raise ValueError(f"period must be one of {PERIODS}, not {self.period!r}")
        if self.budget_micros is not None and (
            not is_int(self.budget_micros) or self.budget_micros < 0
        ):
            raise ValueError("budget_micros must be a non-negative integer or None")
        for name in KINDS:
            rate = getattr(self, name)
            if rate is not None and (not is_int(rate) or rate < 1):
                raise ValueError(f"{name} must be a positive integer or None")
        w = self.weight
        if w is not None and (
            isinstance(w, bool)
            or not isinstance(w, int | float)
            or not MIN_WEIGHT <= w <= MAX_WEIGHT
        ):
            raise ValueError(
                f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g} or None"
            )


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a request holds. ``cost_micros`` is the amount held now (0 when settled).

    ``replayed``: the id was already reserved, nothing new was charged.
    ``settled``: the id was already reconciled, nothing is held (``charged_micros``
    is what it was charged).
    """

    request_id: str
    scope: Scope
    cost_micros: int
    tokens: int
    created_at: float
    expires_at: float
    replayed: bool = False
    settled: bool = False
    charged_micros: int = 0
    weight: float = 1.0  # the tenant's share weight, read with its limits


def period_buckets(now: float) -> dict[Period, str]:
    """The budget counter buckets of ``now`` (UTC)."""
    dt = datetime.fromtimestamp(now, tz=UTC)
    return {"day": dt.strftime("%Y%m%d"), "month": dt.strftime("%Y%m"), "total": "total"}


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_level(level: str) -> None:
    if level not in get_args(Level):
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")


def as_period(v: str | None) -> Period:
    """A stored period name; anything else reads as the default, ``month``."""
    for p in PERIODS:
        if v == p:
            return p
    return "month"

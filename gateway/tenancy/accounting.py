"""Budgets and rate limits in Redis, shared by every gateway replica.

The gateway calls :meth:`Accountant.reserve` before it publishes a request and
:meth:`Accountant.reconcile` (or :meth:`Accountant.release`) after the request's
terminal outcome. Both are single Lua scripts, so every replica sees one
consistent state no matter how many requests race.

Money is integer micro-USD everywhere (1 USD = 1_000_000); Redis never holds a float
amount. Every request has a :class:`Scope` ``(org, tenant, key_id)``; limits are set
per level (``org``, ``tenant``, ``key``) with :class:`LimitSpec`.

Redis keys (``P`` = the ``prefix``, default ``jetserve:acct:``)::

    P limits:<level>:<ident>             hash  budget, period, rpm, tpm (absent = unlimited)
    P spend:<level>:<bucket>:<ident>     hash  spent, reserved (micro-USD integers)
    P gcra:<rpm|tpm>:<level>:<ident>     string the GCRA theoretical arrival time (µs)
    P resv:<request_id>                  hash  one live reservation: amounts and counters
    P done:<request_id>                  string the charge of a settled request (short-lived)
    P resv-expiry                        zset  request_id by hold expiry (µs), for sweeping

``bucket`` is the UTC day ``YYYYMMDD``, the UTC month ``YYYYMM`` or ``total``. It is
computed from ``clock()`` here, not by the script (scripts stay deterministic and a
test clock drives them), and each level's counters for all three periods are passed
as KEYS: the script picks the one named by that level's ``period``, so a concurrent
``set_limits`` can never make a reservation read one period and charge another.

Atomicity. Redis runs a script to completion with no other command interleaved, so
the read phase (limits, counters, GCRA state) and the write phase see the same
state. A Lua error half-way would not roll back earlier writes, so the scripts do
every check and every conversion before their first write, and the writes are plain
integer increments that cannot fail. A rejected request therefore changes nothing.

Idempotency. ``reserve`` of a request id that is already held returns that hold
(``replayed=True``) without charging or checking limits again; ``reserve`` of an id
settled within ``settled_ttl_s`` returns ``settled=True`` and holds nothing.
``reconcile`` of an id that holds nothing returns 0. That makes redis-py's automatic
retry of a command whose reply was lost safe, and a gateway retry safe.

Periods. A request is charged in the period bucket it was reserved in, even when
it is reconciled after the period rolled over (its hold is in that bucket).

Overshoot. The reservation is the worst case (prompt estimate + max_tokens at the
route's price). If the actual charge is larger anyway (an estimate was wrong),
``reconcile`` charges the actual amount: spend is the truth, so ``spent`` may then
pass the budget by that overshoot, and further reservations are refused.

Rate limits (GCRA). Per limit the state is one number, the theoretical arrival time
``TAT``. With ``rate`` units per minute the emission interval is ``T = 60 s / rate``
per unit (a request for ``rpm``, a worst-case token for ``tpm``); a request of ``n``
units has ``inc = n * T``. With ``now``::

    new_tat = max(TAT, now) + inc
    allowed  iff  new_tat - now <= max(burst_s, inc)
    retry_after = new_tat - now - max(burst_s, inc)        (exact, from the TAT)

``burst_s`` (default 6 s, a tenth of the minute) is the burst tolerance: from an idle
state ``rate * burst_s / 60`` units pass at once (at least one request), then one
unit per ``T``. Under saturated offered load the admitted count over a window of
``W`` seconds that starts idle is therefore ``rate * (W + burst_s) / 60`` (rounded
down to whole requests), and in steady state ``rate * W / 60``; no 60 s window ever
admits more than ``rate * (60 + burst_s) / 60``. ``max(burst_s, inc)`` lets a request
larger than the burst (a big ``max_tokens`` against a small ``tpm``) pass once the
limiter is idle instead of never, and it then pays for itself: later requests wait
until its tokens have drained. A request of more units than ``rate`` (more tokens
than a whole minute allows) can never be served and is refused with
:class:`RequestTooLarge`. Rate units are not refunded on reconcile (like OpenAI, the
worst case counts against ``tpm``). ``now`` is the calling replica's clock, so
replicas need synchronised clocks (NTP): a replica whose clock runs ``d`` ahead can
admit up to ``rate * d / 60`` extra units.

Checks run broadest level first; if several fail the caller gets
:class:`BudgetExceeded` (not retryable: retrying into a spent budget is pointless)
before :class:`RequestTooLarge`, before :class:`RateLimited` (with the longest wait
of the limits that failed, so the retry can pass all of them).

Abandoned holds. A reservation carries a hold expiry (``hold_s``, default 30 min, far
past the gateway's longest deadline). :meth:`Accountant.sweep_expired` releases
holds past it, so a gateway that died between reserve and reconcile does not keep
budget reserved forever; run it periodically from one or more replicas (it is safe
to run concurrently). The reservation hash itself expires in Redis a day after the
hold, only to bound memory if nothing sweeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import redis.asyncio as redis
from redis.exceptions import RedisError

from gateway.errors import BadRequest, GatewayError, Unavailable
from gateway.errors import RateLimited as _RateLimited
from gateway.tenancy.keys import KeyRecord

__all__ = [
    "Accountant",
    "AccountingUnavailable",
    "BudgetExceeded",
    "Level",
    "LimitKind",
    "LimitSpec",
    "Period",
    "RateLimited",
    "RequestTooLarge",
    "Reservation",
    "Scope",
    "period_buckets",
]

Level = Literal["org", "tenant", "key"]
Period = Literal["day", "month", "total"]
LimitKind = Literal["rpm", "tpm"]

LEVELS: tuple[Level, ...] = ("org", "tenant", "key")
PERIODS: tuple[Period, ...] = ("day", "month", "total")
KINDS: tuple[LimitKind, ...] = ("rpm", "tpm")

# How long an idle period counter survives in Redis (from its last reservation):
# long enough for reports on the previous period; ``total`` never expires.
_COUNTER_TTL_S: dict[Period, int] = {"day": 40 * 86_400, "month": 400 * 86_400, "total": 0}
# The reservation hash outlives its hold by this much, so the sweeper can still
# read its amounts; after that Redis drops it (memory bound only).
_RESV_GRACE_S = 86_400.0


# -- the model ---------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """Limits of one org, tenant or key. ``None`` means unlimited.

    ``budget_micros`` applies per ``period`` (UTC day, UTC month, or for all time);
    ``rpm`` / ``tpm`` are requests and worst-case tokens per minute (GCRA, see the
    module docstring for the burst).
    """

    budget_micros: int | None = None
    period: Period = "month"
    rpm: int | None = None
    tpm: int | None = None

    def __post_init__(self) -> None:
        if self.period not in PERIODS:
            raise ValueError(f"period must be one of {PERIODS}, not {self.period!r}")
        if self.budget_micros is not None and (
            not _is_int(self.budget_micros) or self.budget_micros < 0
        ):
            raise ValueError("budget_micros must be a non-negative integer or None")
        for name in KINDS:
            rate = getattr(self, name)
            if rate is not None and (not _is_int(rate) or rate < 1):
                raise ValueError(f"{name} must be a positive integer or None")


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


# -- errors ------------------------------------------------------------------------


class BudgetExceeded(GatewayError):
    """429 ``insufficient_quota``, like OpenAI's: the openai SDK raises
    ``RateLimitError`` with this message, and ``x-should-retry: false`` stops it
    from retrying into a spent budget."""

    status = 429
    type = "insufficient_quota"
    code = "budget_exceeded"
    retryable = False

    def __init__(
        self,
        level: Level,
        *,
        ident: str = "",
        period: Period = "month",
        budget_micros: int = 0,
        spent_micros: int = 0,
        reserved_micros: int = 0,
        cost_micros: int = 0,
    ) -> None:
        self.level = level
        self.ident = ident
        self.period = period
        self.budget_micros = budget_micros
        self.spent_micros = spent_micros
        self.reserved_micros = reserved_micros
        self.cost_micros = cost_micros
        left = max(0, budget_micros - spent_micros - reserved_micros)
        span = {"day": "today's", "month": "this month's", "total": "the total"}[period]
        super().__init__(
            f"You exceeded your current quota: this request may cost up to "
            f"{_usd(cost_micros)} but only {_usd(left)} of {span} {level} budget of "
            f"{_usd(budget_micros)} is left ({_usd(spent_micros)} spent, "
            f"{_usd(reserved_micros)} held by requests in flight). Raise the budget or "
            f"lower max_tokens."
        )

    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"}


class RateLimited(_RateLimited):
    """429 ``rate_limit_exceeded``; ``retry_after_s`` is exact (from the GCRA TAT)."""

    def __init__(self, retry_after_s: float, limit: LimitKind, level: Level) -> None:
        self.retry_after_s = retry_after_s
        self.limit = limit
        self.level = level
        unit = "requests" if limit == "rpm" else "tokens"
        super().__init__(
            f"Rate limit reached for {unit} per minute ({limit}) at the {level} level. "
            f"Please try again in {retry_after_s:.3f}s.",
            retry_after=retry_after_s,
        )

    def headers(self) -> dict[str, str]:
        # Retry-After is whole seconds (at least 1); the openai SDK prefers the
        # exact ``retry-after-ms``.
        return {
            **super().headers(),
            "retry-after-ms": str(max(1, math.ceil(self.retry_after_s * 1000))),
        }


class RequestTooLarge(BadRequest):
    """400: the request's worst-case tokens exceed a whole minute of ``tpm``; it can
    never be admitted, so retrying is pointless (lower max_tokens)."""

    code = "request_too_large"

    def __init__(self, level: Level, tokens: int, tpm: int) -> None:
        self.level = level
        self.tokens = tokens
        self.tpm = tpm
        super().__init__(
            f"Request too large: it may use up to {tokens} tokens but the {level} limit "
            f"is {tpm} tokens per minute. Lower max_tokens or shorten the prompt.",
            param="max_tokens",
        )


class AccountingUnavailable(Unavailable):
    """503: no evidence from the accounting store, so the gateway fails closed."""

    code = "accounting_unavailable"


# -- Lua ---------------------------------------------------------------------------

# Kept inline (not as .lua files): the Docker image installs a wheel, and a wheel
# built from this pyproject carries only Python files.

# KEYS  1..3   limits hash of org, tenant, key
#       4..12  spend counters: 4 + 3*(level-1) + (period-1), period day, month, total
#       13..18 GCRA TAT: 13 + 2*(level-1) + (kind-1), kind rpm, tpm
#       19 reservation hash, 20 settled marker, 21 expiry index
# ARGV  1 now (µs), 2 cost (µ-USD), 3 tokens, 4 hold (µs), 5 reservation PEXPIRE (ms),
#       6 burst (µs), 7 request id, 8 org, 9 tenant, 10 key id,
#       11 day counter EXPIRE (s), 12 month counter EXPIRE (s)
_RESERVE_LUA = """
local function int(x) return string.format('%d', x) end

-- Idempotency before any check: a retried reserve must be neither charged again
-- nor refused by a limit its first attempt already passed.
if redis.call('EXISTS', KEYS[19]) == 1 then
  local r = redis.call('HMGET', KEYS[19], 'cost', 'tokens', 'created', 'expires',
                       'org', 'tenant', 'key')
  return {'held', r[1], r[2], r[3], r[4], r[5], r[6], r[7]}
end
local done = redis.call('GET', KEYS[20])
if done then return {'settled', done} end

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local burst = tonumber(ARGV[6])
local period_index = {day = 1, month = 2, total = 3}
local counter_ttl = {tonumber(ARGV[11]), tonumber(ARGV[12]), 0}

-- Read phase. Nothing below writes until every check has passed.
local limits, counters = {}, {}
for i = 1, 3 do
  local l = redis.call('HMGET', KEYS[i], 'budget', 'period', 'rpm', 'tpm')
  local p = period_index[l[2]] or 2
  limits[i] = {budget = tonumber(l[1]), rpm = tonumber(l[3]), tpm = tonumber(l[4])}
  counters[i] = {key = KEYS[3 + 3 * (i - 1) + p], ttl = counter_ttl[p], period = p}
end

-- Budgets, broadest level first. Not retryable, so they win over rate limits.
for i = 1, 3 do
  local budget = limits[i].budget
  if budget then
    local c = redis.call('HMGET', counters[i].key, 'spent', 'reserved')
    local spent, reserved = tonumber(c[1]) or 0, tonumber(c[2]) or 0
    if spent + reserved + cost > budget then
      return {'budget', i, counters[i].period, spent, reserved, budget}
    end
  end
end

-- GCRA for every (level, kind) with a rate; remember the new TATs to write.
local wait, wait_kind, wait_level = 0, 0, 0
local new_tats = {}
for i = 1, 3 do
  for k = 1, 2 do
    local rate, units
    if k == 1 then rate, units = limits[i].rpm, 1 else rate, units = limits[i].tpm, tokens end
    if rate then
      if units > rate then return {'too_large', i, rate, units} end
      local inc = units * 60000000 / rate
      local key = KEYS[13 + 2 * (i - 1) + (k - 1)]
      local tat = tonumber(redis.call('GET', key)) or now
      if tat < now then tat = now end
      local new_tat = tat + inc
      local w = new_tat - now - math.max(burst, inc)
      if w > 0 then
        if w > wait then wait, wait_kind, wait_level = w, k, i end
      else
        new_tats[#new_tats + 1] = {key, new_tat}
      end
    end
  end
end
if wait > 0 then return {'rate', wait_kind, wait_level, math.ceil(wait)} end

-- Write phase: every check passed.
for _, t in ipairs(new_tats) do
  -- Once the TAT is in the past the state equals "no state", so Redis may drop it;
  -- a minute of slack covers replica clocks that differ from Redis's.
  redis.call('SET', t[1], string.format('%.17g', t[2]),
             'PX', int(math.ceil((t[2] - now) / 1000) + 60000))
end
for i = 1, 3 do
  redis.call('HINCRBY', counters[i].key, 'reserved', ARGV[2])
  if counters[i].ttl > 0 then redis.call('EXPIRE', counters[i].key, counters[i].ttl) end
end
local expires = int(now + tonumber(ARGV[4]))
redis.call('HSET', KEYS[19], 'cost', ARGV[2], 'tokens', ARGV[3], 'created', ARGV[1],
           'expires', expires, 'org', ARGV[8], 'tenant', ARGV[9], 'key', ARGV[10],
           'c1', counters[1].key, 'c2', counters[2].key, 'c3', counters[3].key)
redis.call('PEXPIRE', KEYS[19], ARGV[5])
redis.call('ZADD', KEYS[21], expires, ARGV[7])
return {'ok', ARGV[2], ARGV[3], ARGV[1], expires, ARGV[8], ARGV[9], ARGV[10]}
"""

# KEYS 1 reservation hash, 2 settled marker, 3 expiry index, 4..6 the reservation's
#      spend counters (org, tenant, key), read from the hash by the caller
# ARGV 1 actual charge (µ-USD), 2 marker PX (ms), 3 request id
# Returns the charge, -2 when nothing is held, -1 when KEYS 4..6 are not the
# reservation's counters (the caller re-reads them and retries).
_RECONCILE_LUA = """
local r = redis.call('HMGET', KEYS[1], 'cost', 'c1', 'c2', 'c3')
if not r[1] then return -2 end
if r[2] ~= KEYS[4] or r[3] ~= KEYS[5] or r[4] ~= KEYS[6] then return -1 end
local release = string.format('%d', -tonumber(r[1]))
local actual = tonumber(ARGV[1])
for i = 4, 6 do
  redis.call('HINCRBY', KEYS[i], 'reserved', release)
  if actual > 0 then redis.call('HINCRBY', KEYS[i], 'spent', ARGV[1]) end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return actual
"""


# -- the accountant ----------------------------------------------------------------


class Accountant:
    """Reserve, reconcile and inspect budgets and rate limits in Redis.

    ``timeout_s`` bounds every operation (redis-py's own retries included): past it
    the caller gets :class:`AccountingUnavailable`, the gateway fails closed. A
    timed-out ``reserve`` may still have been applied; retrying it with the same
    request id returns that hold, and an abandoned one is released by
    :meth:`sweep_expired`.
    """

    def __init__(
        self,
        redis: redis.Redis,
        *,
        prefix: str = "jetserve:acct:",
        clock: Callable[[], float] = time.time,
        burst_s: float = 6.0,
        hold_s: float = 1800.0,
        settled_ttl_s: float = 1800.0,
        timeout_s: float | None = 2.0,
    ) -> None:
        if burst_s < 0 or hold_s <= 0 or settled_ttl_s <= 0:
            raise ValueError("burst_s must be >= 0, hold_s and settled_ttl_s > 0")
        self._redis = redis
        self._prefix = prefix
        self._clock = clock
        self.burst_s = burst_s
        self.hold_s = hold_s
        self.settled_ttl_s = settled_ttl_s
        self._timeout_s = timeout_s
        # register_script: EVALSHA, and on NOSCRIPT (a restarted or new server)
        # SCRIPT LOAD and EVALSHA again.
        self._reserve = redis.register_script(_RESERVE_LUA)
        self._reconcile = redis.register_script(_RECONCILE_LUA)

    # keys

    def _limits_key(self, level: Level, ident: str) -> str:
        return f"{self._prefix}limits:{level}:{ident}"

    def _spend_key(self, level: Level, bucket: str, ident: str) -> str:
        return f"{self._prefix}spend:{level}:{bucket}:{ident}"

    def _gcra_key(self, kind: LimitKind, level: Level, ident: str) -> str:
        return f"{self._prefix}gcra:{kind}:{level}:{ident}"

    def _resv_key(self, request_id: str) -> str:
        return f"{self._prefix}resv:{request_id}"

    def _done_key(self, request_id: str) -> str:
        return f"{self._prefix}done:{request_id}"

    @property
    def _index_key(self) -> str:
        return f"{self._prefix}resv-expiry"

    @contextlib.asynccontextmanager
    async def _store(self, what: str) -> AsyncIterator[None]:
        """Any failure to get an answer from Redis -> AccountingUnavailable."""
        try:
            async with asyncio.timeout(self._timeout_s):
                yield
        except (RedisError, OSError, TimeoutError) as exc:
            raise AccountingUnavailable(
                f"The accounting store is unavailable ({what}); "
                "requests are refused until it answers."
            ) from exc

    # limits

    async def set_limits(self, level: Level, ident: str, spec: LimitSpec) -> None:
        _check_level(level)
        _check_ident(ident)
        fields: dict[str, str] = {"period": spec.period}
        for name, value in (("budget", spec.budget_micros), ("rpm", spec.rpm), ("tpm", spec.tpm)):
            if value is not None:
                fields[name] = str(value)
        key = self._limits_key(level, ident)
        # MULTI/EXEC: a reserve never sees the old fields half-replaced.
        async with (
            self._store("set_limits"),
            self._redis.pipeline(transaction=True) as pipe,
        ):
            pipe.delete(key)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            await pipe.execute()

    async def get_limits(self, level: Level, ident: str) -> LimitSpec:
        _check_level(level)
        async with self._store("get_limits"):
            raw = await self._redis.hmget(
                self._limits_key(level, ident), ["budget", "period", "rpm", "tpm"]
            )
        budget, period, rpm, tpm = (_opt_str(v) for v in raw)
        return LimitSpec(
            budget_micros=None if budget is None else int(budget),
            period=_period(period),
            rpm=None if rpm is None else int(rpm),
            tpm=None if tpm is None else int(tpm),
        )

    # the request path

    async def reserve(
        self,
        scope: Scope,
        request_id: str,
        cost_micros: int,
        tokens: int,
        *,
        hold_s: float | None = None,
    ) -> Reservation:
        """Check every limit of the hierarchy and hold ``cost_micros`` at every level,
        atomically; raise :class:`BudgetExceeded`, :class:`RequestTooLarge`,
        :class:`RateLimited` or :class:`AccountingUnavailable` and change nothing."""
        for ident in (scope.org, scope.tenant, scope.key_id, request_id):
            _check_ident(ident)
        if not _is_int(cost_micros) or cost_micros < 0:
            raise ValueError("cost_micros must be a non-negative integer")
        if not _is_int(tokens) or tokens < 0:
            raise ValueError("tokens must be a non-negative integer")
        hold = self.hold_s if hold_s is None else hold_s
        if hold <= 0:
            raise ValueError("hold_s must be positive")
        now = self._clock()
        now_us = int(now * 1_000_000)
        buckets = period_buckets(now)
        keys: list[str] = [self._limits_key(lv, scope.ident(lv)) for lv in LEVELS]
        keys += [self._spend_key(lv, buckets[p], scope.ident(lv)) for lv in LEVELS for p in PERIODS]
        keys += [self._gcra_key(k, lv, scope.ident(lv)) for lv in LEVELS for k in KINDS]
        keys += [self._resv_key(request_id), self._done_key(request_id), self._index_key]
        args: list[str | int] = [
            now_us,
            cost_micros,
            tokens,
            int(hold * 1_000_000),
            math.ceil((hold + _RESV_GRACE_S) * 1000),
            int(self.burst_s * 1_000_000),
            request_id,
            scope.org,
            scope.tenant,
            scope.key_id,
            _COUNTER_TTL_S["day"],
            _COUNTER_TTL_S["month"],
        ]
        async with self._store("reserve"):
            reply = await self._reserve(keys=keys, args=args)
        status = _str(reply[0])
        if status in ("ok", "held"):
            return Reservation(
                request_id=request_id,
                scope=Scope(_str(reply[5]), _str(reply[6]), _str(reply[7])),
                cost_micros=int(reply[1]),
                tokens=int(reply[2]),
                created_at=int(reply[3]) / 1_000_000,
                expires_at=int(reply[4]) / 1_000_000,
                replayed=status == "held",
            )
        if status == "settled":
            return Reservation(
                request_id=request_id,
                scope=scope,
                cost_micros=0,
                tokens=0,
                created_at=now,
                expires_at=now,
                replayed=True,
                settled=True,
                charged_micros=int(reply[1]),
            )
        if status == "budget":
            level = LEVELS[int(reply[1]) - 1]
            raise BudgetExceeded(
                level,
                ident=scope.ident(level),
                period=PERIODS[int(reply[2]) - 1],
                spent_micros=int(reply[3]),
                reserved_micros=int(reply[4]),
                budget_micros=int(reply[5]),
                cost_micros=cost_micros,
            )
        if status == "too_large":
            raise RequestTooLarge(LEVELS[int(reply[1]) - 1], int(reply[3]), int(reply[2]))
        if status == "rate":
            raise RateLimited(
                int(reply[3]) / 1_000_000, KINDS[int(reply[1]) - 1], LEVELS[int(reply[2]) - 1]
            )
        raise AccountingUnavailable(f"Unexpected reply from the reserve script: {status!r}")

    async def reconcile(self, request_id: str, actual_micros: int) -> int:
        """Turn the hold into the actual charge at every level, atomically; return the
        charge (``actual_micros``, charged in full even above the hold). A request
        that holds nothing (already reconciled, released, swept, never reserved)
        returns 0 and changes nothing."""
        return (await self.settle(request_id, actual_micros))[1]

    async def settle(self, request_id: str, actual_micros: int) -> tuple[bool, int]:
        """:meth:`reconcile`, also telling whether this call settled the hold
        (False: someone else did, or there was none). Whoever settles a request
        writes its ledger record, so two gateways finishing one request (a resumed
        stream) produce one record."""
        _check_ident(request_id)
        if not _is_int(actual_micros) or actual_micros < 0:
            raise ValueError("actual_micros must be a non-negative integer")
        resv = self._resv_key(request_id)
        async with self._store("reconcile"):
            # The counters a reservation charged are in its hash; they are read first
            # so the script can be given every key it touches. The script re-checks
            # them, and a reservation never changes, so a mismatch only means it
            # went away (0) or, after a settled marker expired, was made again.
            for _ in range(3):
                counters = await self._redis.hmget(resv, ["c1", "c2", "c3"])
                if counters[0] is None:
                    return False, 0
                charged = int(
                    await self._reconcile(
                        keys=[
                            resv,
                            self._done_key(request_id),
                            self._index_key,
                            *(_str(c or b"") for c in counters),
                        ],
                        args=[actual_micros, math.ceil(self.settled_ttl_s * 1000), request_id],
                    )
                )
                if charged >= 0:
                    return True, charged
                if charged == -2:
                    return False, 0
        raise AccountingUnavailable(f"Reservation {request_id} kept changing; not reconciled")

    async def release(self, request_id: str) -> None:
        """Give the whole hold back (the request failed before costing anything)."""
        await self.reconcile(request_id, 0)

    async def spend(self, level: Level, ident: str) -> tuple[int, int]:
        """``(spent, reserved)`` in micro-USD for the current period of ``level``."""
        spec = await self.get_limits(level, ident)
        bucket = period_buckets(self._clock())[spec.period]
        async with self._store("spend"):
            spent, reserved = await self._redis.hmget(
                self._spend_key(level, bucket, ident), ["spent", "reserved"]
            )
        return int(spent or 0), int(reserved or 0)

    async def sweep_expired(self, limit: int = 1000) -> int:
        """Release up to ``limit`` holds past their expiry (their holder died);
        return how many were released. Safe to run from several replicas at once."""
        now_us = int(self._clock() * 1_000_000)
        async with self._store("sweep"):
            due: Sequence[Any] = await self._redis.zrangebyscore(
                self._index_key, "-inf", now_us, start=0, num=limit
            )
        released = 0
        for raw in due:
            request_id = _str(raw)
            async with self._store("sweep"):
                exists = await self._redis.exists(self._resv_key(request_id))
            if exists:
                await self.release(request_id)
                released += 1
            else:
                # Reconciled meanwhile, or dropped by Redis; just forget it.
                async with self._store("sweep"):
                    await self._redis.zrem(self._index_key, request_id)
        return released


# -- helpers -----------------------------------------------------------------------


def period_buckets(now: float) -> dict[Period, str]:
    """The budget counter buckets of ``now`` (UTC)."""
    dt = datetime.fromtimestamp(now, tz=UTC)
    return {"day": dt.strftime("%Y%m%d"), "month": dt.strftime("%Y%m"), "total": "total"}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_level(level: str) -> None:
    if level not in get_args(Level):
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")


def _check_ident(ident: str) -> None:
    if not isinstance(ident, str) or not ident:
        raise ValueError("identifiers must be non-empty strings")


def _str(v: bytes | str | int) -> str:
    if isinstance(v, bytes):
        return v.decode()
    return str(v)


def _opt_str(v: bytes | str | None) -> str | None:
    return None if v is None else _str(v)


def _period(v: str | None) -> Period:
    for p in PERIODS:
        if v == p:
            return p
    return "month"


def _usd(micros: int) -> str:
    return f"${micros / 1_000_000:,.6f}".rstrip("0").rstrip(".") if micros else "$0"

"""Budgets and rate limits in Redis, shared by every gateway replica.

The gateway calls :meth:`Accountant.reserve` before it publishes a request and
:meth:`Accountant.reconcile` (or :meth:`Accountant.release`) after the request's
terminal outcome. Both are single Lua scripts, so every replica sees one
consistent state no matter how many requests race.

Money is integer micro-USD everywhere (1 USD = 1_000_000); Redis never holds a float
amount. Every request has a :class:`Scope` ``(org, tenant, key_id)``; limits are set
per level (``org``, ``tenant``, ``key``) with :class:`LimitSpec`.

Redis keys: gateway/tenancy/accounting_keys.py. Each is tagged with the request's
org (``jetserve:acct:{<org>}:...``), so one request's scripts name keys of one
Redis Cluster hash slot; limits, spend and holds of a tenant or key are therefore
addressed with their org (``org=``), and settling names the org it reserved in.

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
to run concurrently). Each org keeps its own expiry index; the sweep finds them
through the registry of orgs with holds (accounting_keys.py says why that stays
complete under concurrent reserves). The reservation hash itself expires in Redis a day after the
hold, only to bound memory if nothing sweeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import AccountingUnavailable
from gateway.tenancy.accounting_keys import (
    DEFAULT_PREFIX,
    PRUNE_LUA,
    REGISTRY_MARGIN_S,
    REGISTRY_REFRESH_S,
    AccountingKeys,
)
from gateway.tenancy.accounting_lua import RECONCILE_LUA, RESERVE_LUA, as_str, reservation_of
from gateway.tenancy.limits import (
    KINDS,
    LEVELS,
    MAX_AMOUNT_MICROS,
    PERIODS,
    Level,
    LimitKind,
    LimitSpec,
    Period,
    Reservation,
    Scope,
    as_period,
    check_level,
    is_int,
    period_buckets,
)
from streams.redis_client import RedisClient

# The Accountant's types, importable from here with it.
__all__ = [
    "Accountant",
    "ExpiredHold",
    "Level",
    "LimitKind",
    "LimitSpec",
    "Period",
    "Reservation",
    "Scope",
    "period_buckets",
]

# How long an idle period counter survives in Redis (from its last reservation):
# long enough for reports on the previous period; ``total`` never expires.
_COUNTER_TTL_S: dict[Period, int] = {"day": 40 * 86_400, "month": 400 * 86_400, "total": 0}
# The reservation hash outlives its hold by this much, so the sweeper can still
# read its amounts; after that Redis drops it (memory bound only).
_RESV_GRACE_S = 86_400.0
# A hold's ``what`` note, in bytes at most (a record's head is ~250).
MAX_WHAT = 4096
# The reconcile script's answers (gateway/tenancy/accounting_lua.py).
_SETTLE_STATES = {1: "applied", 2: "repeat", 3: "other", 0: "none"}


@dataclass(frozen=True, slots=True)
class ExpiredHold:
    """A hold past its expiry (its holder died, or is cut off), with what its
    holder wrote of it."""

    org: str
    tenant: str
    request_id: str
    cost_micros: int = 0
    what: str = ""  # the holder's note (reserve's ``what``); "" from an older gateway


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
        redis: RedisClient,
        *,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.time,
        burst_s: float = 6.0,
        hold_s: float = 1800.0,
        settled_ttl_s: float = 1800.0,
        timeout_s: float | None = 2.0,
    ) -> None:
        if burst_s < 0 or hold_s <= 0 or settled_ttl_s <= 0:
            raise ValueError("burst_s must be >= 0, hold_s and settled_ttl_s > 0")
        self._redis = redis
        self.keys = AccountingKeys(prefix)
        # org -> this process's clock when it last registered the org as one
        # that holds (accounting_keys.py): registered again past the refresh.
        self._registered: dict[str, float] = {}
        self._clock = clock
        self.burst_s = burst_s
        self.hold_s = hold_s
        self.settled_ttl_s = settled_ttl_s
        self._timeout_s = timeout_s
        # register_script: EVALSHA, and on NOSCRIPT (a restarted or new server)
        # SCRIPT LOAD and EVALSHA again.
        self._reserve = redis.register_script(RESERVE_LUA)
        self._reconcile = redis.register_script(RECONCILE_LUA)
        self._prune = redis.register_script(PRUNE_LUA)

    # keys

    def _org_of(self, level: Level, ident: str, org: str | None) -> str:
        """The org whose slot holds ``level``/``ident``: an org is its own; a
        tenant's or key's must be named (its limits live beside its org's)."""
        check_level(level)
        _check_ident(ident)
        if level == "org":
            if org is not None and org != ident:
                raise ValueError(f"org limits of {ident!r} named with another org {org!r}")
            return ident
        if org is None:
            raise ValueError(f"the {level} {ident!r} needs its org (org=...)")
        _check_ident(org)
        return org

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

    async def set_limits(
        self, level: Level, ident: str, spec: LimitSpec, *, org: str | None = None
    ) -> None:
        org = self._org_of(level, ident, org)
        fields: dict[str, str] = {"period": spec.period}
        for name, value in (
            ("budget", spec.budget_micros),
            ("rpm", spec.rpm),
            ("tpm", spec.tpm),
            ("weight", spec.weight),
        ):
            if value is not None:
                fields[name] = repr(float(value)) if name == "weight" else str(value)
        key = self.keys.limits(org, level, ident)
        # MULTI/EXEC: a reserve never sees the old fields half-replaced.
        async with (
            self._store("set_limits"),
            self._redis.pipeline(transaction=True) as pipe,
        ):
            pipe.delete(key)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            await pipe.execute()

    async def get_limits(self, level: Level, ident: str, *, org: str | None = None) -> LimitSpec:
        org = self._org_of(level, ident, org)
        async with self._store("get_limits"):
            raw = await self._redis.hmget(
                self.keys.limits(org, level, ident), ["budget", "period", "rpm", "tpm", "weight"]
            )
        budget, period, rpm, tpm, weight = (_opt_str(v) for v in raw)
        return LimitSpec(
            budget_micros=None if budget is None else int(budget),
            period=as_period(period),
            rpm=None if rpm is None else int(rpm),
            tpm=None if tpm is None else int(tpm),
            weight=None if weight is None else float(weight),
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
        what: str = "",
    ) -> Reservation:
        """Check every limit of the hierarchy and hold ``cost_micros`` at every level,
        atomically; raise :class:`BudgetExceeded`, :class:`RequestTooLarge`,
        :class:`RateLimited` or :class:`AccountingUnavailable` and change nothing.
        ``what``: the holder's note of what the hold is for (at most
        ``MAX_WHAT`` bytes), handed back by :meth:`expired` so a hold whose holder
        died before anything ran can still be recorded."""
        for ident in (scope.org, scope.tenant, scope.key_id, request_id):
            _check_ident(ident)
        # Capped: each hold is added to the org's counters (64-bit in Redis).
        _check_amount("cost_micros", cost_micros, MAX_AMOUNT_MICROS)
        _check_amount("tokens", tokens, MAX_AMOUNT_MICROS)
        if len(what.encode()) > MAX_WHAT:
            raise ValueError(f"what: at most {MAX_WHAT} bytes")
        hold = self.hold_s if hold_s is None else hold_s
        if hold <= 0:
            raise ValueError("hold_s must be positive")
        now = self._clock()
        async with self._store("reserve"):
            await self._register(scope.org, now)
            reply = await self._reserve(
                keys=self._reserve_keys(scope, request_id, now),
                args=[*self._reserve_args(scope, request_id, cost_micros, tokens, hold, now), what],
            )
        return reservation_of(reply, scope, request_id, cost_micros, now)

    async def _register(self, org: str, now: float) -> None:
        """Name ``org`` in the registry of orgs with holds before holding for it
        (again once the refresh has passed), so the sweep finds its index."""
        last = self._registered.get(org)
        if last is not None and 0 <= now - last < REGISTRY_REFRESH_S:
            return
        await self._redis.zadd(self.keys.registry, {org: int(now * 1_000_000)}, gt=True)
        if len(self._registered) > 100_000:
            self._registered.clear()
        self._registered[org] = now

    def _reserve_keys(self, scope: Scope, request_id: str, now: float) -> list[str]:
        """The reserve script's KEYS, in its order (gateway/tenancy/accounting_lua.py);
        all in the org's hash slot."""
        buckets = period_buckets(now)
        k, org = self.keys, scope.org
        keys: list[str] = [k.limits(org, lv, scope.ident(lv)) for lv in LEVELS]
        keys += [k.spend(org, lv, buckets[p], scope.ident(lv)) for lv in LEVELS for p in PERIODS]
        keys += [k.gcra(org, kind, lv, scope.ident(lv)) for lv in LEVELS for kind in KINDS]
        keys += [k.resv(org, request_id), k.done(org, request_id), k.index(org)]
        return keys

    def _reserve_args(
        self, scope: Scope, request_id: str, cost_micros: int, tokens: int, hold: float, now: float
    ) -> list[str | int]:
        """The reserve script's ARGV, in its order."""
        return [
            int(now * 1_000_000),
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

    async def reconcile(self, request_id: str, actual_micros: int, *, org: str) -> int:
        """Turn the hold into the actual charge at every level, atomically; return the
        charge (``actual_micros``, charged in full even above the hold). A request
        that holds nothing (already reconciled, released, swept, never reserved)
        returns 0 and changes nothing."""
        return (await self.settle(request_id, actual_micros, org=org))[1]

    async def settle(
        self, request_id: str, actual_micros: int, writer: str = "", *, org: str
    ) -> tuple[bool, int]:
        state, charge = await self.settle_as(request_id, actual_micros, writer, org=org)
        return state in ("applied", "repeat"), charge

    async def settle_as(
        self, request_id: str, actual_micros: int, writer: str = "", *, org: str
    ) -> tuple[str, int]:
        """:meth:`reconcile`, also telling whether this call settled the hold
        (False: someone else did, or there was none). Whoever settles a request
        writes its ledger record, so two gateways finishing one request (a resumed
        stream) produce one record.

        ``writer`` names the settlement (gateway/inference/settlements.py): a
        settlement applied again by the same writer (its reply was lost, or it
        was redelivered from the outbox) answers ``(True, the charge it applied)``
        and changes nothing, so its ledger record can still be written.

        ``org`` is the org the request was reserved in (its keys' hash tag)."""
        _check_ident(request_id)
        _check_ident(org)
        _check_amount("actual_micros", actual_micros)
        resv = self.keys.resv(org, request_id)
        async with self._store("reconcile"):
            # The counters a reservation charged are in its hash; they are read first
            # so the script can be given every key it touches. The script re-checks
            # them, and a reservation never changes, so a mismatch only means it
            # went away (0) or, after a settled marker expired, was made again.
            for _ in range(3):
                counters = await self._redis.hmget(resv, ["c1", "c2", "c3"])
                state, charged = await self._reconcile(
                    keys=[
                        resv,
                        self.keys.done(org, request_id),
                        self.keys.index(org),
                        # No hash (settled already): the script reads only the
                        # marker; the reservation's own key stands in for the
                        # counters (a key the gateway's Redis user may name).
                        *(as_str(c) if c else resv for c in counters),
                    ],
                    args=[
                        actual_micros,
                        math.ceil(self.settled_ttl_s * 1000),
                        request_id,
                        writer,
                    ],
                )
                name = _SETTLE_STATES.get(int(state))
                if name is not None:
                    return name, int(charged) if name in ("applied", "repeat") else 0
        raise AccountingUnavailable(f"Reservation {request_id} kept changing; not reconciled")

    async def expired(self, limit: int = 1000) -> list[ExpiredHold]:
        """Up to ``limit`` holds past their expiry (their holder died, or is cut
        off), over every org, for the caller to settle from evidence."""
        now = self._clock()
        now_us = int(now * 1_000_000)
        out: list[ExpiredHold] = []
        for org in await self._orgs_with_holds(now):
            index = self.keys.index(org)
            # One timeout per org: a sweep over many orgs is not one operation.
            async with self._store("sweep"):
                due: Sequence[Any] = await self._redis.zrangebyscore(
                    index, "-inf", now_us, start=0, num=limit - len(out)
                )
                for raw in due:
                    request_id = as_str(raw)
                    tenant, cost, what = await self._redis.hmget(
                        self.keys.resv(org, request_id), "tenant", "cost", "what"
                    )
                    if tenant is None:  # reconciled meanwhile, or dropped by Redis
                        await self._redis.zrem(index, request_id)
                    else:
                        out.append(
                            ExpiredHold(
                                org,
                                as_str(tenant),
                                request_id,
                                cost_micros=int(cost or 0),
                                what=as_str(what or b""),
                            )
                        )
            if len(out) >= limit:
                break
        return out

    async def _orgs_with_holds(self, now: float) -> list[str]:
        """Every org in the registry; those long unregistered with no holds are
        dropped from it on the way (accounting_keys.py: why that is safe)."""
        # The cutoff is taken before any index is read: a reserve that lands
        # after that read registered after the cutoff, so its org stays.
        cutoff_us = int((now - REGISTRY_REFRESH_S - REGISTRY_MARGIN_S) * 1_000_000)
        registry = self.keys.registry
        async with self._store("sweep"):
            entries: Sequence[Any] = await self._redis.zrange(registry, 0, -1, withscores=True)
        orgs: list[str] = []
        for raw, score in entries:
            org = as_str(raw)
            if score < cutoff_us:
                async with self._store("sweep"):
                    if not await self._redis.zcard(self.keys.index(org)):
                        await self._prune(keys=[registry], args=[org, cutoff_us])
                        continue
            orgs.append(org)
        return orgs

    async def release(self, request_id: str, *, org: str) -> None:
        """Give the whole hold back (the request failed before costing anything)."""
        await self.reconcile(request_id, 0, org=org)

    async def spend(self, level: Level, ident: str, *, org: str | None = None) -> tuple[int, int]:
        """``(spent, reserved)`` in micro-USD for the current period of ``level``."""
        org = self._org_of(level, ident, org)
        spec = await self.get_limits(level, ident, org=org)
        bucket = period_buckets(self._clock())[spec.period]
        async with self._store("spend"):
            spent, reserved = await self._redis.hmget(
                self.keys.spend(org, level, bucket, ident), ["spent", "reserved"]
            )
        return int(spent or 0), int(reserved or 0)

    async def sweep_expired(self, limit: int = 1000) -> int:
        """Release up to ``limit`` holds past their expiry (their holder died);
        return how many were released. Safe to run from several replicas at once."""
        released = 0
        for hold in await self.expired(limit):
            state, _ = await self.settle_as(hold.request_id, 0, org=hold.org)
            released += state == "applied"
        return released


def _check_ident(ident: str) -> None:
    if not isinstance(ident, str) or not ident:
        raise ValueError("identifiers must be non-empty strings")


def _check_amount(name: str, value: int, most: int | None = None) -> None:
    if not is_int(value) or value < 0 or (most is not None and value > most):
        raise ValueError(f"{name} must be an integer in [0, {most if most else 'any'}]")


def _opt_str(v: bytes | str | None) -> str | None:
    return None if v is None else as_str(v)

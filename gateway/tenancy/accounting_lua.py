"""The accountant's two Lua scripts, their KEYS and ARGV, and the reserve
script's reply read back (gateway/tenancy/accounting.py runs them).

Redis runs a script to completion with no other command interleaved, so each reads
and writes one consistent state. Every check and conversion comes before the first
write, so a refused reservation changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.errors import AccountingUnavailable, BudgetExceeded, RateLimited, RequestTooLarge
from gateway.tenancy.limits import KINDS, LEVELS, PERIODS, Reservation, Scope

# Kept inline (not as .lua files): the Docker image installs a wheel, and a wheel
# built from this pyproject carries only Python files.

# KEYS  1..3   limits hash of org, tenant, key
#       4..12  spend counters: 4 + 3*(level-1) + (period-1), period day, month, total
#       13..18 GCRA TAT: 13 + 2*(level-1) + (kind-1), kind rpm, tpm
#       19 reservation hash, 20 settled marker, 21 expiry index
# ARGV  1 now (µs), 2 cost (µ-USD), 3 tokens, 4 hold (µs), 5 reservation PEXPIRE (ms),
#       6 burst (µs), 7 request id, 8 org, 9 tenant, 10 key id,
#       11 day counter EXPIRE (s), 12 month counter EXPIRE (s)
RESERVE_LUA = """
local function int(x) return string.format('%d', x) end

-- Idempotency before any check: a retried reserve must be neither charged again
-- nor refused by a limit its first attempt already passed.
if redis.call('EXISTS', KEYS[19]) == 1 then
  local r = redis.call('HMGET', KEYS[19], 'cost', 'tokens', 'created', 'expires',
                       'org', 'tenant', 'key')
  local w = redis.call('HGET', KEYS[2], 'weight') or ''
  return {'held', r[1], r[2], r[3], r[4], r[5], r[6], r[7], w}
end
local done_type = redis.call('TYPE', KEYS[20]).ok
if done_type == 'hash' then return {'settled', redis.call('HGET', KEYS[20], 'charge')} end
if done_type == 'string' then return {'settled', redis.call('GET', KEYS[20])} end

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local burst = tonumber(ARGV[6])
local period_index = {day = 1, month = 2, total = 3}
local counter_ttl = {tonumber(ARGV[11]), tonumber(ARGV[12]), 0}

-- Read phase. Nothing below writes until every check has passed.
local limits, counters = {}, {}
for i = 1, 3 do
  local l = redis.call('HMGET', KEYS[i], 'budget', 'period', 'rpm', 'tpm', 'weight')
  local p = period_index[l[2]] or 2
  limits[i] = {budget = tonumber(l[1]), rpm = tonumber(l[3]), tpm = tonumber(l[4]),
               weight = l[5] or ''}
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
           'c1', counters[1].key, 'c2', counters[2].key, 'c3', counters[3].key,
           'what', ARGV[13])
redis.call('PEXPIRE', KEYS[19], ARGV[5])
redis.call('ZADD', KEYS[21], expires, ARGV[7])
return {'ok', ARGV[2], ARGV[3], ARGV[1], expires, ARGV[8], ARGV[9], ARGV[10],
        limits[2].weight}
"""

# KEYS 1 reservation hash, 2 settled marker, 3 expiry index, 4..6 the reservation's
#      spend counters (org, tenant, key), read from the hash by the caller
# ARGV 1 actual charge (µ-USD), 2 marker PX (ms), 3 request id, 4 writer ("" anonymous)
# Returns {state, charge}: 1 settled by this call; 2 settled before by the same
# (non-empty) writer, with the charge it applied (a redelivered settlement);
# 3 settled by another writer; 0 nothing held and no marker; -1 KEYS 4..6 are not
# the reservation's counters (the caller re-reads them and retries).
RECONCILE_LUA = """
local r = redis.call('HMGET', KEYS[1], 'cost', 'c1', 'c2', 'c3')
if not r[1] then
  local m = redis.call('HMGET', KEYS[2], 'charge', 'writer')
  if not m[1] then
    -- A marker from before writers were recorded is a plain string.
    if redis.call('TYPE', KEYS[2]).ok == 'string' then
      return {3, tonumber(redis.call('GET', KEYS[2]))}
    end
    return {0, 0}
  end
  if ARGV[4] ~= '' and m[2] == ARGV[4] then return {2, tonumber(m[1])} end
  return {3, tonumber(m[1])}
end
if r[2] ~= KEYS[4] or r[3] ~= KEYS[5] or r[4] ~= KEYS[6] then return {-1, 0} end
local release = string.format('%d', -tonumber(r[1]))
local actual = tonumber(ARGV[1])
for i = 4, 6 do
  redis.call('HINCRBY', KEYS[i], 'reserved', release)
  if actual > 0 then redis.call('HINCRBY', KEYS[i], 'spent', ARGV[1]) end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[2], 'charge', ARGV[1], 'writer', ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {1, actual}
"""


def _weight(raw: Any) -> float:
    """The tenant's share weight as its limits store it ('' or absent: 1)."""
    text = as_str(raw) if raw is not None else ""
    try:
        return float(text) if text else 1.0
    except ValueError:
        return 1.0


def reservation_of(
    reply: Sequence[Any], scope: Scope, request_id: str, cost_micros: int, now: float
) -> Reservation:
    """The reserve script's reply as a Reservation, or the refusal it names, raised."""
    status = as_str(reply[0])
    if status in ("ok", "held"):
        return Reservation(
            request_id=request_id,
            scope=Scope(as_str(reply[5]), as_str(reply[6]), as_str(reply[7])),
            cost_micros=int(reply[1]),
            tokens=int(reply[2]),
            created_at=int(reply[3]) / 1_000_000,
            expires_at=int(reply[4]) / 1_000_000,
            replayed=status == "held",
            weight=_weight(reply[8] if len(reply) > 8 else None),
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
        raise RequestTooLarge.over_tpm(LEVELS[int(reply[1]) - 1], int(reply[3]), int(reply[2]))
    if status == "rate":
        raise RateLimited.over_limit(
            int(reply[3]) / 1_000_000, KINDS[int(reply[1]) - 1], LEVELS[int(reply[2]) - 1]
        )
    raise AccountingUnavailable(f"Unexpected reply from the reserve script: {status!r}")


def as_str(v: bytes | str | int) -> str:
    if isinstance(v, bytes):
        return v.decode()
    return str(v)

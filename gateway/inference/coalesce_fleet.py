"""Coalescing across gateway replicas (issue 15: fleet-wide caps): identical
temperature-0 requests that land on different replicas share one execution.

One Redis hash per coalescing key (``jetserve:coalesce:{<scope>/<digest>}``, the
key of gateway/inference/coalesce.py) names the execution in flight: its
request id, its tenant, its deadline, and ``n``, the number of replicas whose
group follows it. The replica that claims the key publishes and leads; a
replica that finds it follows the execution's frames capture (an ordered
consumer, as a resume does) and fans them out to its own members.

Guarantees:

- **One execution** for identical requests that overlap in flight, whichever
  replica each reaches, as long as Redis answers. A replica that arrives before
  the leader's capture has its head frame waits up to :data:`FOLLOW_WAIT_S`,
  then runs its own (correct, only not shared).
- **The engine stops only when nobody anywhere follows.** A replica whose last
  member leaves takes its group out of ``n``; the one that takes ``n`` to 0
  cancels the execution. Until then the others keep reading it.
- **Charged once,** by the leader while it reads to the end, as on one replica.
  ``jetserve:coalesce:{<key>}:paid:<request id>`` holds the charge's state: ``lead``
  from the claim; ``open`` when the leader's group leaves others reading; then
  the first follower group's payer to settle takes it (``done``). A group that
  leaves while others follow pays nothing. A leader's replica that dies keeps
  the charge: the orphan sweep settles its record from the capture.
- **Redis unreachable:** a replica coalesces only its own requests; a group
  that cannot leave cleanly never cancels (the engine runs to its end) and its
  leader still pays; a follower that cannot take the charge does not pay.
- A replica that dies mid-execution stays counted in ``n`` until the hash
  expires (the leader's deadline): the engine then runs to its end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from streams.redis_client import RedisClient

log = logging.getLogger(__name__)

FOLLOW_WAIT_S = 1.0  # for the leader's head frame to reach the capture
PAID_TTL_S = 3600
GRACE_MS = 30_000  # the hash outlives the deadline a little: settling is after it

# KEYS[1] the key's hash, KEYS[2] our charge's state. ARGV: our id, tenant,
# deadline, TTL (ms), the earliest leader deadline we accept, the charge's TTL (s).
# Returns {'lead'}, {'late'} (the execution ends too early for us: run our own,
# unshared) or {'follow', id, tenant}.
_CLAIM = """
local cur = redis.call('HMGET', KEYS[1], 'id', 'tenant', 'deadline', 'n')
if cur[1] and tonumber(cur[4] or '0') > 0 then
  if tonumber(cur[3]) < tonumber(ARGV[5]) then return {'late'} end
  redis.call('HINCRBY', KEYS[1], 'n', 1)
  return {'follow', cur[1], cur[2]}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'tenant', ARGV[2], 'deadline', ARGV[3], 'n', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SET', KEYS[2], 'lead', 'EX', ARGV[6])
return {'lead'}
"""
# KEYS[1] the hash, KEYS[2] the execution's charge; ARGV[1] its id, ARGV[2] 1
# when the leaving group leads. Returns the groups still following after ours
# (0: ours was the last, the hash is gone), or -1 when the hash no longer names
# this execution (it ended). A leader that leaves others reading opens the
# charge to them.
_LEAVE = """
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return -1 end
local n = redis.call('HINCRBY', KEYS[1], 'n', -1)
if n <= 0 then
  redis.call('DEL', KEYS[1])
elseif ARGV[2] == '1' and redis.call('GET', KEYS[2]) == 'lead' then
  redis.call('SET', KEYS[2], 'open', 'KEEPTTL')
end
return n
"""
# KEYS[1] the hash, ARGV[1] the execution's id: forget it once it has ended.
_END = """
if redis.call('HGET', KEYS[1], 'id') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""
# KEYS[1] the execution's charge; ARGV[1] the state this group may take it in
# ('lead' for the leading group, 'open' for a follower once the leader left).
_PAY = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], 'done', 'KEEPTTL')
  return 1
end
return 0
"""


# Both keys of a claim are tagged with the coalescing key (a Redis Cluster hash
# tag: ``<scope>/<digest>`` never holds a brace), so a script names one slot and
# different requests spread over the primaries by their digest.
def hash_key(key: str) -> str:
    return f"jetserve:coalesce:{{{key}}}"


def paid_key(key: str, request_id: str) -> str:
    return f"jetserve:coalesce:{{{key}}}:paid:{request_id}"


@dataclass(frozen=True, slots=True)
class Claim:
    """What Redis said of a key: lead it, follow ``request_id``, or neither."""

    kind: str  # "lead" | "follow" | "late" | "unshared" (Redis unreachable)
    request_id: str = ""
    tenant: str = ""


class FleetCoalescing:
    def __init__(self, rds: RedisClient) -> None:
        self._claim = rds.register_script(_CLAIM)
        self._leave = rds.register_script(_LEAVE)
        self._end = rds.register_script(_END)
        self._pay = rds.register_script(_PAY)

    async def claim(
        self, key: str, request_id: str, tenant: str, deadline: float, earliest: float
    ) -> Claim:
        ttl_ms = max(1000, int((deadline - time.time()) * 1000)) + GRACE_MS
        try:
            reply = await self._claim(
                keys=[hash_key(key), paid_key(key, request_id)],
                args=[request_id, tenant, repr(deadline), ttl_ms, earliest, PAID_TTL_S],
            )
        except (RedisError, OSError) as exc:
            log.warning("coalescing registry unreachable (%r): this replica's own only", exc)
            return Claim("unshared")
        kind = _text(reply[0])
        if kind == "follow":
            return Claim(kind, _text(reply[1]), _text(reply[2]))
        return Claim(kind)

    async def leave(self, key: str, request_id: str, *, leads: bool) -> int | None:
        """Groups still following after ours left; None when Redis did not say."""
        try:
            return int(
                await self._leave(
                    keys=[hash_key(key), paid_key(key, request_id)], args=[request_id, int(leads)]
                )
            )
        except (RedisError, OSError) as exc:
            log.warning("coalescing registry unreachable on leave (%r): engine left running", exc)
            return None

    async def end(self, key: str, request_id: str) -> None:
        try:
            await self._end(keys=[hash_key(key)], args=[request_id])
        except (RedisError, OSError) as exc:
            # The hash expires with the deadline; until then joiners replay a
            # finished capture, which is still the right answer.
            log.warning("coalescing registry unreachable on end (%r)", exc)

    async def pay(self, key: str, request_id: str, *, leads: bool) -> bool:
        """Whether this group's payer is the one member, fleet-wide, that pays: the
        leader's, unless it left others reading; then the first of theirs to settle."""
        try:
            state = "lead" if leads else "open"
            return bool(await self._pay(keys=[paid_key(key, request_id)], args=[state]))
        except (RedisError, OSError) as exc:
            log.warning("coalescing payer unknown (%r): the leader pays", exc)
            return leads


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

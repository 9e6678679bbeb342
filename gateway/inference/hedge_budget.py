"""The hedge budget, one per class for the whole fleet (issue 15: fleet-wide caps).

Every hedge-eligible request earns its class ``max_extra_ratio`` of a hedge. A
replica adds what its requests earned to one Redis counter per class every
``flush_s`` (capped at :data:`BANK_CAP`: what a quiet spell can bank for the
next burst), and sends a hedge only after taking one whole credit from that
counter in one script. So, whatever the number of replicas:

- hedges sent, fleet-wide, <= credit earned fleet-wide + BANK_CAP: a credit is
  taken once, by one replica, and the bank is one bank, not one per replica;
- earned credit reaches the bank at most ``flush_s`` late, so the first hedges
  of a burst may be refused: the cap errs low, never high;
- Redis unreachable: no hedge (a hedge is an extra, never a must), and credit
  earned meanwhile is kept to be added later.

Before this, each replica kept its own bank: N replicas could burst N times the
cap. Key: ``jetserve:hedge:<class>`` (the class is the gateway's, never the
client's text).
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from streams.redis_client import RedisClient
from streams.tasks import stop_task

log = logging.getLogger(__name__)

BANK_CAP = 10.0  # hedges a quiet spell can bank for the next burst, fleet-wide
FLUSH_S = 0.25
KEY_TTL_S = 3600  # an idle class's bank is forgotten after an hour

# KEYS[1] the bank; ARGV: credit to add, the cap, the TTL.
_ADD = """
local v = tonumber(redis.call('INCRBYFLOAT', KEYS[1], ARGV[1]))
if v > tonumber(ARGV[2]) then redis.call('SET', KEYS[1], ARGV[2]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
# KEYS[1] the bank: 1 and one credit fewer when it holds a whole one, else 0.
_TAKE = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
if v >= 1 then
  redis.call('INCRBYFLOAT', KEYS[1], -1)
  return 1
end
return 0
"""


def bank_key(cls: str) -> str:
    return f"jetserve:hedge:{cls}"


class SharedHedgeBudget:
    def __init__(self, rds: RedisClient, flush_s: float = FLUSH_S) -> None:
        self._rds = rds
        self._flush_s = flush_s
        self._earned: dict[str, float] = {}  # not yet added to the bank
        self._add = rds.register_script(_ADD)
        self._take = rds.register_script(_TAKE)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="hedge-budget")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
        await self.flush()

    def earn(self, cls: str, credit: float) -> None:
        self._earned[cls] = self._earned.get(cls, 0.0) + credit

    async def take(self, cls: str) -> bool:
        """One hedge's credit from the fleet's bank for ``cls``, if it holds one."""
        await self.flush()  # what this replica earned counts at once
        try:
            return bool(await self._take(keys=[bank_key(cls)]))
        except (RedisError, OSError) as exc:
            log.warning("hedge budget unreadable (%r): no hedge", exc)
            return False

    async def flush(self) -> None:
        earned, self._earned = self._earned, {}
        for cls, credit in earned.items():
            try:
                await self._add(keys=[bank_key(cls)], args=[credit, BANK_CAP, KEY_TTL_S])
            except (RedisError, OSError) as exc:
                log.warning("hedge credit not banked yet (%r): kept", exc)
                self.earn(cls, credit)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._flush_s)
            if self._earned:
                await self.flush()

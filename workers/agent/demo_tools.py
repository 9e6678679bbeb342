"""Tools for demos and tests, with effects kept in Redis where a test can see them.

- ``transfer`` (side-effecting, with ``reconcile``): moves money between accounts;
- ``transfer_unreconciled``: the same effect, without ``reconcile`` (a crash
  between its intent and outcome can only end ``ambiguous``);
- ``payout`` (requires approval, with ``reconcile``): pays an account out;
- ``balance`` (read-only) and ``sleep`` (read-only, interruptible waits).

The bank is idempotent on the call's key, as a real payment API is: an effect
applied once is never applied again, and a repeat is logged in
``<prefix>repeats`` (so a test can prove nobody even tried). Every applied
effect is one JSON entry of ``<prefix>log``; ``<prefix>applied`` maps each key
to its receipt, which is what ``reconcile(key)`` reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from streams.redis_client import RedisClient
from tools import InProcess, Outcome, Tier, Tool, ToolContext, ToolFailure

Hook = Callable[[str, ToolContext], None]
# Its own Redis ACL user may touch only ``demobank:*``. The script names four keys
# of the bank: one hash tag, one Redis Cluster slot.
PREFIX = "demobank:{bank}:"
MAX_AMOUNT = 1_000_000

# One atomic step: apply once per key (else log the repeat), move the balances.
_APPLY = """
local existing = redis.call('HGET', KEYS[1], ARGV[1])
if existing then
  redis.call('RPUSH', KEYS[3], ARGV[1])
  return existing
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[2])
if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[3], -tonumber(ARGV[5])) end
redis.call('HINCRBY', KEYS[4], ARGV[4], tonumber(ARGV[5]))
return ARGV[2]
"""

_TRANSFER = {
    "type": "object",
    "properties": {
        "from": {"type": "string", "minLength": 1, "maxLength": 64},
        "to": {"type": "string", "minLength": 1, "maxLength": 64},
        "amount": {"type": "integer", "exclusiveMinimum": 0},
    },
    "required": ["from", "to", "amount"],
    "additionalProperties": False,
}
_PAYOUT = {
    "type": "object",
    "properties": {
        "to": {"type": "string", "minLength": 1, "maxLength": 64},
        "amount": {"type": "integer", "exclusiveMinimum": 0},
    },
    "required": ["to", "amount"],
    "additionalProperties": False,
}
_BALANCE = {
    "type": "object",
    "properties": {"account": {"type": "string", "minLength": 1}},
    "required": ["account"],
    "additionalProperties": False,
}
_SLEEP = {
    "type": "object",
    "properties": {"seconds": {"type": "number", "minimum": 0, "maximum": 600}},
    "required": ["seconds"],
    "additionalProperties": False,
}


def _no_hook(point: str, ctx: ToolContext) -> None:
    pass


class DemoBank:
    def __init__(self, client: RedisClient, *, hook: Hook = _no_hook, prefix: str = PREFIX) -> None:
        self._redis = client
        self._hook = hook
        self.prefix = prefix
        self._apply = client.register_script(_APPLY)

    @property
    def keys(self) -> list[str]:
        p = self.prefix
        return [f"{p}applied", f"{p}log", f"{p}repeats", f"{p}balances"]

    async def _effect(self, kind: str, src: str, dst: str, amount: int, ctx: ToolContext) -> Any:
        if amount > MAX_AMOUNT:
            raise ToolFailure(f"amount over the limit of {MAX_AMOUNT}", retryable=False)
        self._hook("after_intent", ctx)
        entry = msgspec.json.encode(
            {"key": ctx.key, "kind": kind, "from": src, "to": dst, "amount": amount}
        )
        raw = await self._apply(keys=self.keys, args=[ctx.key, entry, src, dst, amount])
        self._hook("after_effect", ctx)
        return msgspec.json.decode(raw)

    async def transfer(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        return await self._effect("transfer", args["from"], args["to"], args["amount"], ctx)

    async def payout(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        return await self._effect("payout", "", args["to"], args["amount"], ctx)

    async def reconcile(self, key: str) -> Outcome | None:
        raw = await self._redis.hget(f"{self.prefix}applied", key)
        return None if raw is None else Outcome.success(msgspec.json.decode(raw))

    async def balance(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        raw = await self._redis.hget(f"{self.prefix}balances", args["account"])
        return {"account": args["account"], "balance": int(raw or 0)}


async def sleep(args: dict[str, Any], ctx: ToolContext) -> Any:
    await asyncio.sleep(float(args["seconds"]))
    return {"slept": args["seconds"]}


def demo_tools(bank: DemoBank) -> list[Tool]:
    return [
        Tool(
            "transfer",
            "Move an amount of money from one account to another.",
            _TRANSFER,
            InProcess(bank.transfer),
            tier=Tier.SIDE_EFFECTING,
            timeout_s=2.0,
            reconcile=bank.reconcile,
        ),
        Tool(
            "transfer_unreconciled",
            "Move money (a bank that cannot answer whether a transfer happened).",
            _TRANSFER,
            InProcess(bank.transfer),
            tier=Tier.SIDE_EFFECTING,
            timeout_s=2.0,
        ),
        Tool(
            "payout",
            "Pay an amount out to an account; a human approves each payout.",
            _PAYOUT,
            InProcess(bank.payout),
            tier=Tier.REQUIRES_APPROVAL,
            timeout_s=5.0,
            reconcile=bank.reconcile,
        ),
        Tool(
            "balance",
            "The balance of an account.",
            _BALANCE,
            InProcess(bank.balance),
            timeout_s=5.0,
        ),
        Tool("sleep", "Wait a number of seconds.", _SLEEP, InProcess(sleep), timeout_s=600.0),
    ]

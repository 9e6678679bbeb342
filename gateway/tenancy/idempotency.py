"""Idempotency-Key for non-streaming requests.

The first request with a (tenant, key) pair claims it in Redis (SET NX) and
runs; its response is stored under the pair. A retry gets the stored response
(no engine call, no charge); a concurrent duplicate waits for the first. The
request id is derived from the pair, so JetStream's Nats-Msg-Id dedupe also
covers a gateway that crashed between publishing and answering. Retryable
failures (429/5xx) release the claim so a later retry runs again.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as redis
from redis.exceptions import RedisError

from gateway.errors import BadRequest, GatewayError, Timeout, Unavailable

PREFIX = "jetserve:idem:"
HEADER = "idempotency-key"


class Stored(msgspec.Struct, frozen=True):
    state: str  # "pending" | "done"
    body_hash: str
    status: int = 0
    response: dict[str, Any] | None = None


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Stored)


@dataclass(frozen=True)
class Claim:
    request_id: str
    key_hash: str
    replay: Stored | None = None  # set: answer with this, run nothing


def key_hash(tenant: str, idempotency_key: str) -> str:
    return hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()


class IdempotencyStore:
    def __init__(self, client: redis.Redis, ttl_s: float = 24 * 3600, poll_s: float = 0.05) -> None:
        self._redis = client
        self._ttl = int(ttl_s)
        self._poll = poll_s

    async def claim(self, tenant: str, idem_key: str, body: bytes, deadline: float) -> Claim:
        if not idem_key or len(idem_key) > 255:
            raise BadRequest("Idempotency-Key must be 1-255 characters.", param=HEADER)
        kh = key_hash(tenant, idem_key)
        body_hash = hashlib.sha256(body).hexdigest()
        pending = _enc.encode(Stored("pending", body_hash))
        rkey = PREFIX + kh
        # A pending claim lives only as long as its request can: if its gateway
        # dies, a retry takes over after that instead of waiting out the full TTL.
        pending_ttl = max(1, math.ceil(deadline - time.time()) + 30)
        try:
            while True:
                if await self._redis.set(rkey, pending, nx=True, ex=pending_ttl):
                    # Each run of a key gets its own request id (a retry after a
                    # failure must not collide with the first run's settled hold);
                    # a retry of the same run keeps it, so JetStream dedupes it.
                    attempt = await self._redis.incr(PREFIX + "attempt:" + kh)
                    await self._redis.expire(PREFIX + "attempt:" + kh, self._ttl)
                    return Claim(f"{kh[:24]}{attempt:08x}", kh)
                raw = await self._redis.get(rkey)
                if raw is None:
                    continue  # released between our SET and GET: claim again
                stored = _dec.decode(raw)
                if stored.body_hash != body_hash:
                    raise BadRequest(
                        "Idempotency-Key was already used with a different request body.",
                        code="idempotency_key_reused",
                        param=HEADER,
                    )
                if stored.state == "done":
                    return Claim(kh[:32], kh, stored)  # a replay: the id is not used
                if time.time() >= deadline:
                    raise Timeout("A request with this Idempotency-Key is still running.")
                await asyncio.sleep(self._poll)  # a concurrent duplicate: wait for the first
        except (RedisError, OSError) as exc:
            raise Unavailable("Idempotency store unavailable.") from exc

    async def complete(
        self, claim: Claim, body: bytes, status: int, response: dict[str, Any]
    ) -> None:
        stored = Stored("done", hashlib.sha256(body).hexdigest(), status, response)
        await self._redis.set(PREFIX + claim.key_hash, _enc.encode(stored), ex=self._ttl)

    async def fail(self, claim: Claim, body: bytes, exc: GatewayError) -> None:
        if exc.retryable or exc.status >= 500:
            await self._redis.delete(PREFIX + claim.key_hash)  # let a retry run again
        else:
            await self.complete(claim, body, exc.status, exc.body())

"""Idempotency-Key, for streaming and non-streaming requests alike.

The first request with a (tenant, key) pair claims it in Redis (SET NX) and
runs under a request id derived from the pair: the key's hash and a generation
that changes only when a run failed in a way a retry may repair (429/5xx, a
client that cancelled). A retry within the window therefore names the same
request, and:

- the first run finished, not streaming: gets the stored response (no engine
  call, no charge);
- the first run is in flight, or finished streaming: attaches to its frames
  (the resume path; gateway/inference/service.py), on any replica, even when the
  first run's gateway died: the engine works once, the books get one record;
- the first run's gateway died before it queued anything: takes the run over
  with the same request id after ``takeover_s`` (the work queue's
  ``Nats-Msg-Id`` de-duplication stores the request once even if it was queued).

The window (``ttl_s``, ``GatewayConfig.idempotency_window_s``) counts from the
first claim; the frames capture and the work queue's de-duplication window must
be at least as long (the runtime checks it), so whatever a retry can find in
Redis it can also find on the bus.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.exceptions import RedisError

from gateway.errors import BadRequest, GatewayError, Timeout, Unavailable
from streams.redis_client import RedisClient

PREFIX = "jetserve:idem:"
HEADER = "idempotency-key"


class Stored(msgspec.Struct, frozen=True):
    state: str  # "pending" | "done"
    body_hash: str
    status: int = 0
    response: dict[str, Any] | None = None  # None when done: a stream, replayed from frames
    request_id: str = ""
    created: float = 0.0  # the first claim (unix seconds)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Stored)


@dataclass(frozen=True)
class Claim:
    request_id: str
    key_hash: str
    replay: Stored | None = None  # set: answer with this, run nothing
    attach: bool = False  # the first run is in flight or streamed: follow its frames
    created: float = 0.0


def key_hash(tenant: str, idempotency_key: str) -> str:
    return hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()


class IdempotencyStore:
    def __init__(self, client: RedisClient, ttl_s: float = 600.0, poll_s: float = 0.05) -> None:
        self._redis = client
        self.ttl_s = ttl_s
        self._poll = poll_s

    async def claim(self, tenant: str, idem_key: str, body: bytes, deadline: float) -> Claim:
        if not idem_key or len(idem_key) > 255:
            raise BadRequest("Idempotency-Key must be 1-255 characters.", param=HEADER)
        kh = key_hash(tenant, idem_key)
        body_hash = hashlib.sha256(body).hexdigest()
        rkey = PREFIX + kh
        try:
            while True:
                # A new generation only when a claim is made: a retry of the same
                # run finds the claim and keeps its request id.
                now = time.time()
                gen_key = PREFIX + "gen:" + kh
                generation = int(await self._redis.get(gen_key) or 0) + 1
                request_id = f"{kh[:24]}{generation:08x}"
                pending = _enc.encode(
                    Stored("pending", body_hash, request_id=request_id, created=now)
                )
                if await self._redis.set(rkey, pending, nx=True, ex=max(1, int(self.ttl_s))):
                    await self._redis.set(gen_key, generation, ex=int(self.ttl_s) + 86_400)
                    return Claim(request_id, kh, created=now)
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
                if stored.state == "done" and stored.response is not None:
                    return Claim(stored.request_id or kh[:32], kh, stored)
                if stored.request_id:
                    return Claim(stored.request_id, kh, attach=True, created=stored.created)
                # A claim from before request ids were stored: wait for it.
                if time.time() >= deadline:
                    raise Timeout("A request with this Idempotency-Key is still running.")
                await asyncio.sleep(self._poll)
        except (RedisError, OSError) as exc:
            raise Unavailable("Idempotency store unavailable.") from exc

    async def complete(
        self, claim: Claim, body: bytes, status: int, response: dict[str, Any] | None
    ) -> None:
        """The run's answer (``response`` None: a stream, replayed from its frames),
        kept until the window that began with the first claim ends."""
        stored = Stored(
            "done",
            hashlib.sha256(body).hexdigest(),
            status,
            response,
            claim.request_id,
            claim.created,
        )
        await self._redis.set(PREFIX + claim.key_hash, _enc.encode(stored), keepttl=True)

    async def release(self, claim: Claim) -> None:
        """Let a retry run again, under a new request id."""
        gen_key = PREFIX + "gen:" + claim.key_hash
        await self._redis.set(gen_key, int(claim.request_id[24:], 16), ex=int(self.ttl_s) + 86_400)
        await self._redis.delete(PREFIX + claim.key_hash)

    async def fail(self, claim: Claim, body: bytes, exc: GatewayError) -> None:
        if exc.retryable or exc.status >= 500:
            await self.release(claim)
        else:
            await self.complete(claim, body, exc.status, exc.body())

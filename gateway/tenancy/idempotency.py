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

Ownership. The session that made the claim (or took it over) owns it: it
releases the claim for a retry (a 429/5xx, a cancel) only while the claim is
still the one it made (a script compares the request id and the owner's token: a
late release never deletes a later run's claim, nor one another session took
over). A retry following the run owns nothing: its own failure (its link to
NATS, a silent stream) is not the run's and leaves the claim as it is; the run's
own outcome (its answer, or an error frame it ended with, ``run_failed``) it
records as the owner would, so a retryable failure of a run whose gateway died
can still be retried and a finished one is replayed.

The window (``ttl_s``, ``GatewayConfig.idempotency_window_s``) counts from the
first claim; the frames capture and the work queue's de-duplication window must
be at least as long (the runtime checks it), so whatever a retry can find in
Redis it can also find on the bus.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.exceptions import RedisError

from gateway.errors import BadRequest, GatewayError, Timeout, Unavailable
from streams.redis_client import RedisClient

PREFIX = "jetserve:idem:"
_ALIVE = PREFIX + "alive:"  # the owner, while it admits its run (short-lived)
HEADER = "idempotency-key"


class Stored(msgspec.Struct, frozen=True):
    state: str  # "pending" | "done"
    body_hash: str
    status: int = 0
    response: dict[str, Any] | None = None  # None when done: a stream, replayed from frames
    request_id: str = ""
    created: float = 0.0  # the first claim (unix seconds)
    owner: str = ""  # the owning session's token ("": a claim from before owners)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Stored)


@dataclass(frozen=True)
class Claim:
    request_id: str
    key_hash: str
    replay: Stored | None = None  # set: answer with this, run nothing
    attach: bool = False  # the first run is in flight or streamed: follow its frames
    created: float = 0.0
    owner: str = ""  # this session's token when it owns the claim; "": it follows
    seen: str = ""  # a follower's: the owner's token when it found the claim
    fresh: bool = False  # made by this session's claim() (not found, not taken over)


# Release or complete a claim only while it is the one the caller holds (the
# same run's request id; the same owner, when the caller names one). The gen key
# is refreshed apart (another hash slot on a cluster); it holds the same value.
_GUARDED_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, s = pcall(cjson.decode, raw)
if not ok or s['request_id'] ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' and s['owner'] and s['owner'] ~= ARGV[3] then return 0 end
if ARGV[1] == 'complete' then
  redis.call('SET', KEYS[1], ARGV[4], 'KEEPTTL')
  return 1
end
if ARGV[1] == 'own' then
  -- Compare-and-set on the value read: two retries never both take it over.
  if raw ~= ARGV[5] or s['state'] ~= 'pending' then return 0 end
  redis.call('SET', KEYS[1], ARGV[4], 'KEEPTTL')
  return 1
end
if s['state'] ~= 'pending' then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


# A marker deleted only while it is still the caller's: another session's, set
# since, stays.
_DEL_IF_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


# A forgotten claim's generation goes back one (the key goes at 0), only while it
# is still that claim's: a claim made since keeps its own.
_GEN_BACK_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
end
return 1
"""


def key_hash(tenant: str, idempotency_key: str) -> str:
    return hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()


class IdempotencyStore:
    def __init__(self, client: RedisClient, ttl_s: float = 600.0, poll_s: float = 0.05) -> None:
        self._redis = client
        self.ttl_s = ttl_s
        self._poll = poll_s
        self._guard = client.register_script(_GUARDED_LUA)  # EVALSHA, loaded on NOSCRIPT
        self._gen_back = client.register_script(_GEN_BACK_LUA)
        self._del_if = client.register_script(_DEL_IF_LUA)

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
                owner = secrets.token_hex(8)
                pending = _enc.encode(
                    Stored("pending", body_hash, request_id=request_id, created=now, owner=owner)
                )
                if await self._redis.set(rkey, pending, nx=True, ex=max(1, int(self.ttl_s))):
                    await self._redis.set(gen_key, generation, ex=int(self.ttl_s) + 86_400)
                    return Claim(request_id, kh, created=now, owner=owner, fresh=True)
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
                    return Claim(
                        stored.request_id, kh, attach=True, created=stored.created,
                        seen=stored.owner,
                    )  # fmt: skip
                # A claim from before request ids were stored: wait for it.
                if time.time() >= deadline:
                    raise Timeout("A request with this Idempotency-Key is still running.")
                await asyncio.sleep(self._poll)
        except (RedisError, OSError) as exc:
            raise Unavailable("Idempotency store unavailable.") from exc

    async def complete(
        self, claim: Claim, body: bytes, status: int, response: dict[str, Any] | None
    ) -> bool:
        """The run's answer (``response`` None: a stream, replayed from its frames),
        kept until the window that began with the first claim ends: the run's own
        outcome, so a follower may store it too; only while the claim is still this
        run's (and, for an owner, its own) (False: not stored)."""
        stored = Stored(
            "done",
            hashlib.sha256(body).hexdigest(),
            status,
            response,
            claim.request_id,
            claim.created,
            claim.owner,
        )
        return await self._guarded("complete", claim, claim.owner, _enc.encode(stored))

    async def admitting(self, claim: Claim, for_s: float) -> None:
        """Say the claim's owner is alive and still admitting its run (a hold, the
        fair gate's wait, the publish), for ``for_s``: a retry does not take over a
        run that is merely slow to be queued (:meth:`alive`)."""
        await self._redis.set(_ALIVE + claim.key_hash, claim.owner, px=max(1, int(for_s * 1000)))

    async def alive(self, claim: Claim) -> bool:
        """Whether the claim's owner said lately that it is still admitting."""
        try:
            return bool(await self._redis.exists(_ALIVE + claim.key_hash))
        except (RedisError, OSError) as exc:
            raise Unavailable("Idempotency store unavailable.") from exc

    async def take_over(self, claim: Claim) -> Claim | None:
        """Own a claim whose first run queued nothing within ``takeover_s`` (its
        gateway died, it is thought): from now on the first session's release or
        answer changes nothing. None: the claim changed meanwhile (ended, released,
        or another retry took it over first)."""
        owner = secrets.token_hex(8)
        try:
            raw = await self._redis.get(PREFIX + claim.key_hash)
            if raw is None:
                return None
            stored = msgspec.structs.replace(_dec.decode(raw), owner=owner)
            if stored.request_id != claim.request_id or stored.state != "pending":
                return None
            # Only from the owner it found it with (a takeover since is another's),
            # and only as it reads it now (two at once: one wins).
            if not await self._guarded("own", claim, claim.seen, _enc.encode(stored), raw):
                return None
        except (RedisError, OSError) as exc:
            raise Unavailable("Idempotency store unavailable.") from exc
        return Claim(claim.request_id, claim.key_hash, created=claim.created, owner=owner)

    async def release(self, claim: Claim, *, run_failed: bool = False) -> bool:
        """Let a retry run again, under a new request id: by the claim's owner, or
        by a follower when the run itself failed (``run_failed``); only while the
        claim is still pending under this run's request id (False: left as it is)."""
        if not claim.owner and not run_failed:
            return False  # a follower's own failure is not the run's
        if not await self._guarded("release", claim, claim.owner, b""):
            return False
        gen_key = PREFIX + "gen:" + claim.key_hash
        await self._redis.set(gen_key, int(claim.request_id[24:], 16), ex=int(self.ttl_s) + 86_400)
        return True

    async def forget(self, claim: Claim) -> bool:
        """Undo a fresh claim whose request was refused before anything was held
        or queued under its id (a rate limit, a spent budget): its key and its
        generation go, as if never claimed, and a retry is judged anew. Released
        or completed instead, each such refusal left a key for a day (the
        generation) or the window (the refusal, replayed even after the budget
        was raised): a tenant refused for free, one new Idempotency-Key per
        request, filled the Redis everyone's books are in. False: not forgotten
        (not fresh, or the claim changed meanwhile)."""
        if not claim.fresh or not await self._guarded("release", claim, claim.owner, b""):
            return False
        # Its admission is over. Only its own marker: once the claim is released a
        # retry may claim the key anew and say it admits; deleting that retry's
        # marker let a third retry take over a run that was only slow to queue,
        # and run it twice.
        await self._del_if(keys=[_ALIVE + claim.key_hash], args=[claim.owner])
        generation = int(claim.request_id[24:], 16)
        await self._gen_back(
            keys=[PREFIX + "gen:" + claim.key_hash], args=[str(generation), str(generation - 1)]
        )
        return True

    async def fail(
        self, claim: Claim, body: bytes, exc: GatewayError, *, run_failed: bool = False
    ) -> None:
        if not claim.owner and not run_failed:
            return  # a follower's own failure is not the run's: the claim stays
        if exc.retryable or exc.status >= 500:
            await self.release(claim, run_failed=run_failed)
        else:
            await self.complete(claim, body, exc.status, exc.body())

    async def _guarded(
        self, op: str, claim: Claim, owner: str, value: bytes, expected: bytes | str = b""
    ) -> bool:
        keys = [PREFIX + claim.key_hash]
        args: list[bytes | str] = [op, claim.request_id, owner, value, expected]
        return bool(await self._guard(keys=keys, args=args))

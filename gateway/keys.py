"""API keys: stored hashed in Redis, mapped to a tenant.

The plaintext key is returned once at creation and never stored. Lookups are
cached for ``ttl`` seconds per gateway so a revoked key stops working on every
replica within that time. No Redis evidence -> the caller fails closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time

import msgspec
import redis.asyncio as redis
from redis.exceptions import RedisError

from gateway.errors import AuthenticationFailed, Unavailable

KEY_PREFIX = "jetserve:apikey:"


class KeyRecord(msgspec.Struct, frozen=True):
    key_id: str
    tenant: str
    created: float
    revoked: bool = False


_decoder = msgspec.json.Decoder(KeyRecord)


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def new_plaintext_key() -> str:
    return "sk-js-" + secrets.token_urlsafe(32)


class KeyStore:
    def __init__(self, client: redis.Redis, ttl: float = 1.0) -> None:
        self._redis = client
        self._ttl = ttl
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        # Single flight: concurrent first requests with one key share one lookup.
        self._lookups: dict[str, asyncio.Future[KeyRecord | None]] = {}

    async def create(self, tenant: str, plaintext: str | None = None) -> tuple[str, KeyRecord]:
        key = plaintext or new_plaintext_key()
        record = KeyRecord(key_id="key_" + secrets.token_hex(6), tenant=tenant, created=time.time())
        await self._redis.set(KEY_PREFIX + hash_key(key), msgspec.json.encode(record))
        return key, record

    async def authenticate(self, authorization: str | None) -> KeyRecord:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        digest = hash_key(authorization[7:].strip())
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self._ttl:
            record = hit[1]
        else:
            try:
                raw = await self._redis.get(KEY_PREFIX + digest)
            except (RedisError, OSError) as exc:
                raise Unavailable(
                    "Key store unavailable; refusing to serve unauthenticated."
                ) from exc
            record = _decoder.decode(raw) if raw else None
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[digest] = (now, record)
        if record is None or record.revoked:
            raise AuthenticationFailed("Incorrect API key provided.")
        return record

    async def _fetch(self, digest: str) -> KeyRecord | None:
        try:
            raw = await self._redis.get(KEY_PREFIX + digest)
        except (RedisError, OSError) as exc:
            raise Unavailable("Key store unavailable; refusing to serve unauthenticated.") from exc
        return _decoder.decode(raw) if raw else None

"""Orgs, tenants and API keys, stored in Redis.

Keys are stored hashed (SHA-256) and shown once at creation. A key carries
scopes: the models, request classes, tools and data classes it may use ("*" =
any). Lookups are cached per gateway for ``ttl`` seconds (single flight under a
burst), so a revoked key stops working on every replica within that time. No
Redis evidence -> the caller fails closed (503).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time

import msgspec
import redis.asyncio as redis
from redis.exceptions import RedisError

from gateway.errors import AuthenticationFailed, BadRequest, NotFound, PermissionDenied, Unavailable
from streams.ids import is_safe_id

P = "jetserve:"
ANY = ("*",)


class Org(msgspec.Struct, frozen=True):
    id: str
    name: str = ""
    created: float = 0.0


class Tenant(msgspec.Struct, frozen=True):
    id: str
    org: str
    name: str = ""
    created: float = 0.0


class Scopes(msgspec.Struct, frozen=True, omit_defaults=True):
    models: tuple[str, ...] = ANY
    classes: tuple[str, ...] = ANY
    tools: tuple[str, ...] = ANY
    data_classes: tuple[str, ...] = ANY

    def check(
        self, *, model: str, cls: str, tools: tuple[str, ...] = (), data_class: str = "default"
    ) -> None:
        if "*" not in self.models and model not in self.models:
            raise PermissionDenied(f"This key may not use model '{model}'.", param="model")
        if "*" not in self.classes and cls not in self.classes:
            raise PermissionDenied(f"This key may not use request class '{cls}'.")
        if "*" not in self.tools:
            denied = [t for t in tools if t not in self.tools]
            if denied:
                raise PermissionDenied(f"This key may not use tools {denied}.", param="tools")
        if "*" not in self.data_classes and data_class not in self.data_classes:
            raise PermissionDenied(f"This key may not send data class '{data_class}'.")


class KeyRecord(msgspec.Struct, frozen=True):
    key_id: str
    tenant: str
    org: str = ""
    name: str = ""
    created: float = 0.0
    revoked: bool = False
    scopes: Scopes = Scopes()
    prefix: str = ""  # the first characters of the key, to tell keys apart in listings


_enc = msgspec.json.Encoder()
_key_dec = msgspec.json.Decoder(KeyRecord)
_tenant_dec = msgspec.json.Decoder(Tenant)
_org_dec = msgspec.json.Decoder(Org)


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def new_plaintext_key() -> str:
    return "sk-js-" + secrets.token_urlsafe(32)


def check_id(kind: str, ident: str) -> str:
    if not is_safe_id(ident):
        raise BadRequest(f"{kind} id must match [A-Za-z0-9_-]{{1,64}}: {ident!r}", param="id")
    return ident


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _unavailable(exc: BaseException) -> Unavailable:
    return Unavailable("Key store unavailable; refusing to serve unauthenticated.")


class Tenancy:
    def __init__(self, client: redis.Redis, ttl: float = 1.0) -> None:
        self._redis = client
        self._ttl = ttl
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        # Single flight: a burst of first requests with one key shares one lookup.
        self._lookups: dict[str, asyncio.Future[KeyRecord | None]] = {}

    # -- orgs and tenants ----------------------------------------------------
    async def create_org(self, ident: str, name: str = "") -> Org:
        org = Org(check_id("org", ident), name, time.time())
        if not await self._redis.set(f"{P}org:{ident}", _enc.encode(org), nx=True):
            raise BadRequest(f"Org '{ident}' exists.", code="conflict", status=409)
        await self._redis.sadd(f"{P}orgs", ident)
        return org

    async def get_org(self, ident: str) -> Org:
        raw = await self._redis.get(f"{P}org:{ident}")
        if raw is None:
            raise NotFound(f"Org '{ident}' not found.", code="not_found")
        return _org_dec.decode(raw)

    async def create_tenant(self, ident: str, org: str, name: str = "") -> Tenant:
        check_id("tenant", ident)
        if not await self._redis.exists(f"{P}org:{org}"):
            await self.create_org(org)  # an org is implied by its first tenant
        tenant = Tenant(ident, org, name, time.time())
        if not await self._redis.set(f"{P}tenant:{ident}", _enc.encode(tenant), nx=True):
            raise BadRequest(f"Tenant '{ident}' exists.", code="conflict", status=409)
        await self._redis.sadd(f"{P}tenants", ident)
        return tenant

    async def get_tenant(self, ident: str) -> Tenant:
        raw = await self._redis.get(f"{P}tenant:{ident}")
        if raw is None:
            raise NotFound(f"Tenant '{ident}' not found.", code="not_found")
        return _tenant_dec.decode(raw)

    async def list_tenants(self) -> list[Tenant]:
        ids = sorted(_s(m) for m in await self._redis.smembers(f"{P}tenants"))
        raws = await self._redis.mget([f"{P}tenant:{i}" for i in ids]) if ids else []
        return [_tenant_dec.decode(r) for r in raws if r]

    # -- keys ----------------------------------------------------------------
    async def create_key(
        self,
        tenant: str,
        *,
        name: str = "",
        scopes: Scopes | None = None,
        plaintext: str | None = None,
    ) -> tuple[str, KeyRecord]:
        t = await self.get_tenant(tenant)
        key = plaintext or new_plaintext_key()
        record = KeyRecord(
            key_id="key_" + secrets.token_hex(8),
            tenant=t.id,
            org=t.org,
            name=name,
            created=time.time(),
            scopes=scopes or Scopes(),
            # Enough to tell keys apart in a listing, never enough to matter.
            prefix=key[:8] if len(key) >= 24 else "",
        )
        digest = hash_key(key)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(f"{P}apikey:{digest}", _enc.encode(record))
            pipe.set(f"{P}keyid:{record.key_id}", digest)
            pipe.sadd(f"{P}tenantkeys:{t.id}", record.key_id)
            await pipe.execute()
        return key, record

    async def _record_by_id(self, key_id: str) -> tuple[str, KeyRecord]:
        digest = await self._redis.get(f"{P}keyid:{key_id}")
        raw = await self._redis.get(f"{P}apikey:{_s(digest)}") if digest else None
        if digest is None or raw is None:
            raise NotFound(f"Key '{key_id}' not found.", code="not_found")
        return _s(digest), _key_dec.decode(raw)

    async def get_key(self, key_id: str) -> KeyRecord:
        return (await self._record_by_id(key_id))[1]

    async def list_keys(self, tenant: str) -> list[KeyRecord]:
        ids = sorted(_s(m) for m in await self._redis.smembers(f"{P}tenantkeys:{tenant}"))
        return [(await self._record_by_id(i))[1] for i in ids]

    async def revoke_key(self, key_id: str) -> KeyRecord:
        digest, record = await self._record_by_id(key_id)
        revoked = msgspec.structs.replace(record, revoked=True)
        await self._redis.set(f"{P}apikey:{digest}", _enc.encode(revoked))
        return revoked

    async def rotate_key(self, key_id: str) -> tuple[str, KeyRecord]:
        """A new key with the same tenant, name and scopes; the old one is revoked."""
        _, old = await self._record_by_id(key_id)
        if old.revoked:
            raise BadRequest(f"Key '{key_id}' is revoked.", code="conflict", status=409)
        key, record = await self.create_key(old.tenant, name=old.name, scopes=old.scopes)
        await self.revoke_key(key_id)
        return key, record

    # -- the hot path ----------------------------------------------------------
    async def authenticate(self, authorization: str | None) -> KeyRecord:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        digest = hash_key(authorization[7:].strip())
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self._ttl:
            record = hit[1]
        elif digest in self._lookups:
            record = await asyncio.shield(self._lookups[digest])
        else:
            record = await self._lookup(digest, now)
        if record is None or record.revoked:
            raise AuthenticationFailed("Incorrect API key provided.")
        return record

    async def _lookup(self, digest: str, now: float) -> KeyRecord | None:
        future: asyncio.Future[KeyRecord | None] = asyncio.get_running_loop().create_future()
        self._lookups[digest] = future
        try:
            try:
                raw = await self._redis.get(f"{P}apikey:{digest}")
            except (RedisError, OSError) as exc:
                raise _unavailable(exc) from exc
            record = _key_dec.decode(raw) if raw else None
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: concurrent waiters re-raise it themselves
            raise
        finally:
            del self._lookups[digest]
        future.set_result(record)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[digest] = (now, record)
        return record

"""Orgs, tenants and API keys, stored in Redis.

Keys are shown once at creation and stored only as an HMAC-SHA-256 of the key
under the server's key secret (``JETSERVE_KEY_SECRET``, shared by every gateway
replica): a copy of Redis alone cannot be brute-forced offline, and operator-
chosen keys must be at least :data:`MIN_KEY_CHARS` long. A key stored before
keyed hashing (plain SHA-256) is moved under its keyed digest the first time it
is used (:meth:`Tenancy._upgrade_legacy`), so an upgrade breaks no client.

A key carries scopes: the models, request classes, tools and data classes it
may use ("*" = any), and the actions it may take (:data:`ACTIONS`; by default
``inference`` only, so approving a gated tool call is always granted by name).
Lookups are cached per gateway for ``ttl`` seconds (single flight under a
burst), so a revoked key stops working on every replica within that time. No
Redis evidence -> the caller fails closed (503).

Redis Cluster. Each record is its own key, hashed to its own slot, and no
operation here needs two of them at once: writes that touch several are made in
an order whose every prefix is harmless (a key's record before its id's pointer
and its tenant's list), and a transaction WATCHes and writes one key. So the same
code runs on one Redis and on a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from redis.exceptions import RedisError, WatchError

from gateway.errors import (
    AuthenticationFailed,
    BadRequest,
    NotFound,
    OrgExists,
    PermissionDenied,
    Unavailable,
)
from streams.ids import is_safe_id
from streams.redis_client import RedisClient

P = "jetserve:"
ANY = ("*",)
# 32 characters of even a lowercase alphabet is ~150 bits; a generated key
# (``sk-js-`` + 43 characters of base64url) is longer still.
MIN_KEY_CHARS = 32
# What a key may do. ``inference``: the model API and creating runs. ``approve``:
# decide the gated tool calls of its tenant's runs (never of runs it created,
# gateway/runs/service.py). Reading and cancelling a run needs only the tenant.
ACTIONS = ("inference", "approve")
DEFAULT_ACTIONS = ("inference",)
# ``jetserve gateway --insecure`` without a key secret (development only): public,
# so hashes under it protect nothing; it only keeps keys stable across restarts.
INSECURE_KEY_SECRET = b"jetserve-insecure-development-key-secret"
_WATCH_ROUNDS = 8  # optimistic transactions on one key record before giving up


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
    # Named, never "*": keys stored before actions existed decode to the default.
    actions: tuple[str, ...] = DEFAULT_ACTIONS

    def may(self, action: str) -> bool:
        return action in self.actions

    def validate(self) -> Scopes:
        unknown = sorted(set(self.actions) - set(ACTIONS))
        if unknown or not self.actions:
            raise BadRequest(
                f"scopes.actions must be a non-empty subset of {list(ACTIONS)}: {unknown}",
                param="scopes",
            )
        return self

    def check(
        self, *, model: str, cls: str, tools: tuple[str, ...] = (), data_class: str = "default"
    ) -> None:
        if not self.may("inference"):
            raise PermissionDenied("This key may not call models (it lacks the 'inference' scope).")
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
    # The first key of its rotations ("": this one): rotated, a key is the same
    # party (separation of duties compares lineages, gateway/runs/service.py).
    lineage: str = ""

    @property
    def party(self) -> str:
        """Who holds the key, across rotations: the lineage's first key id."""
        return self.lineage or self.key_id


_enc = msgspec.json.Encoder()
_key_dec = msgspec.json.Decoder(KeyRecord)
_tenant_dec = msgspec.json.Decoder(Tenant)
_org_dec = msgspec.json.Decoder(Org)


def hash_key(plaintext: str, secret: bytes) -> str:
    """The stored form of a key: HMAC-SHA-256 under the server's key secret."""
    return hmac.new(secret, plaintext.encode(), hashlib.sha256).hexdigest()


def legacy_hash_key(plaintext: str) -> str:
    """How keys were stored before keyed hashing (read only, to upgrade them)."""
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


# A transactional pipeline of either client (redis.asyncio's or its cluster's).
Pipeline = Any


async def _optimistic(
    client: RedisClient, watch: str, body: Callable[[Pipeline], Awaitable[bool]]
) -> None:
    """Run ``body`` under WATCH ``watch`` (it reads, calls ``multi()`` and queues
    writes of ``watch`` alone: one cluster slot; False: nothing to write), again
    while another writer moved it. Past a few rounds the WatchError (a
    RedisError) reaches the caller as a store failure: contention that long is
    not worth spinning on."""
    async with client.pipeline(transaction=True) as pipe:
        for _ in range(_WATCH_ROUNDS):
            try:
                await pipe.watch(watch)
                if await body(pipe):
                    await pipe.execute()
                return
            except WatchError:
                continue
            finally:
                await pipe.reset()  # type: ignore[no-untyped-call]
    raise WatchError(f"{watch} kept changing under {_WATCH_ROUNDS} transactions")


def _begin(pipe: Pipeline) -> None:
    """End the WATCHed reads: what follows is queued for EXEC."""
    pipe.multi()


class Tenancy:
    def __init__(self, client: RedisClient, ttl: float = 1.0, *, key_secret: bytes) -> None:
        if not key_secret:
            raise ValueError("Tenancy needs the key secret (GatewayConfig.key_secret)")
        self._redis = client
        self._ttl = ttl
        self._secret = key_secret
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        # Single flight: a burst of first requests with one key shares one lookup.
        self._lookups: dict[str, asyncio.Future[KeyRecord | None]] = {}

    # -- orgs and tenants ----------------------------------------------------
    async def create_org(self, ident: str, name: str = "") -> Org:
        org = Org(check_id("org", ident), name, time.time())
        if not await self._redis.set(f"{P}org:{ident}", _enc.encode(org), nx=True):
            raise OrgExists(f"Org '{ident}' exists.")
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
            # An org is implied by its first tenant; two first tenants at once both
            # imply it (the one that lost the race made it exist all the same).
            with contextlib.suppress(OrgExists):
                await self.create_org(org)
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
        # One GET per tenant, pipelined: on a cluster they are in many slots.
        async with self._redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.get(f"{P}tenant:{i}")
            raws = await pipe.execute() if ids else []
        return [_tenant_dec.decode(r) for r in raws if r]

    # -- keys ----------------------------------------------------------------
    async def create_key(
        self,
        tenant: str,
        *,
        name: str = "",
        scopes: Scopes | None = None,
        plaintext: str | None = None,
        lineage: str = "",
    ) -> tuple[str, KeyRecord]:
        if plaintext is not None and len(plaintext) < MIN_KEY_CHARS:
            raise BadRequest(
                f"api_key must be at least {MIN_KEY_CHARS} characters.", param="api_key"
            )
        scopes = (scopes or Scopes()).validate()
        t = await self.get_tenant(tenant)
        key = plaintext or new_plaintext_key()
        record = KeyRecord(
            key_id="key_" + secrets.token_hex(8),
            tenant=t.id,
            org=t.org,
            name=name,
            created=time.time(),
            scopes=scopes,
            # Enough to tell keys apart in a listing, never enough to matter.
            prefix=key[:8],
            lineage=lineage,
        )
        digest = hash_key(key, self._secret)
        # Three keys, three slots on a cluster: in this order, a failure half-way
        # leaves a record nobody was given (a retry makes a new one), never a
        # listed key id without its record.
        # Create-only: an operator's api_key that is already a key (a migration run
        # twice, a copied demo key) moved that key to this tenant, silently; its
        # old id then pointed at the new record (a revoke of it revoked this one).
        if not await self._redis.set(f"{P}apikey:{digest}", _enc.encode(record), nx=True):
            record = await self._unfinished(digest, t.id)
        await self._redis.set(f"{P}keyid:{record.key_id}", digest)
        await self._redis.sadd(f"{P}tenantkeys:{t.id}", record.key_id)
        return key, record

    async def _unfinished(self, digest: str, tenant: str) -> KeyRecord:
        """The record already under ``digest``, when it is a create of ``tenant``'s
        that failed half-way (its id never pointed at it: unlisted, unrevocable, yet
        live): the retry finishes it. Anything else: 409."""
        raw = await self._redis.get(f"{P}apikey:{digest}")
        found = _key_dec.decode(raw) if raw is not None else None
        if (
            found is None
            or found.tenant != tenant
            or await self._redis.get(f"{P}keyid:{found.key_id}") is not None
        ):
            raise BadRequest(
                "This api_key is already a key; choose another (or omit it).",
                code="conflict",
                status=409,
                param="api_key",
            )
        return found

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
        # The record is revoked under WATCH of its own key (one slot). A legacy
        # key upgraded meanwhile moves its record and repoints its id: the
        # pointer is read again after the write, and the revocation follows it.
        for _ in range(_WATCH_ROUNDS):
            digest = await self._redis.get(f"{P}keyid:{key_id}")
            if digest is None:
                raise NotFound(f"Key '{key_id}' not found.", code="not_found")
            revoked = await self._revoke_record(_s(digest))
            if await self._redis.get(f"{P}keyid:{key_id}") == digest:
                if revoked is None:
                    raise NotFound(f"Key '{key_id}' not found.", code="not_found")
                return revoked
        raise WatchError(f"key {key_id} kept moving under {_WATCH_ROUNDS} revocations")

    async def _revoke_record(self, digest: str) -> KeyRecord | None:
        revoked: KeyRecord | None = None
        record_key = f"{P}apikey:{digest}"

        async def write(pipe: Pipeline) -> bool:
            nonlocal revoked
            raw = await pipe.get(record_key)
            if raw is None:
                return False
            revoked = msgspec.structs.replace(_key_dec.decode(raw), revoked=True)
            _begin(pipe)
            pipe.set(record_key, _enc.encode(revoked))
            return True

        await _optimistic(self._redis, record_key, write)
        return revoked

    async def rotate_key(
        self,
        key_id: str,
        carry: Callable[[KeyRecord, KeyRecord], Awaitable[None]] | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key with the same tenant, name and scopes; the old one is revoked.
        ``carry(old, new)``: what else goes over (the key's limits), before the
        old key is revoked: a failure there leaves the old key working."""
        _, old = await self._record_by_id(key_id)
        if old.revoked:
            raise BadRequest(f"Key '{key_id}' is revoked.", code="conflict", status=409)
        key, record = await self.create_key(
            old.tenant, name=old.name, scopes=old.scopes, lineage=old.party
        )
        if carry is not None:
            await carry(old, record)
        await self.revoke_key(key_id)
        return key, record

    # -- the hot path ----------------------------------------------------------
    async def authenticate(self, authorization: str | None) -> KeyRecord:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        plaintext = authorization[7:].strip()
        digest = hash_key(plaintext, self._secret)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self._ttl:
            record = hit[1]
        elif digest in self._lookups:
            record = await asyncio.shield(self._lookups[digest])
        else:
            record = await self._lookup(digest, legacy_hash_key(plaintext), now)
        if record is None or record.revoked:
            raise AuthenticationFailed("Incorrect API key provided.")
        return record

    async def _lookup(self, digest: str, legacy: str, now: float) -> KeyRecord | None:
        future: asyncio.Future[KeyRecord | None] = asyncio.get_running_loop().create_future()
        self._lookups[digest] = future
        try:
            try:
                raw = await self._redis.get(f"{P}apikey:{digest}")
                if raw is None:
                    raw = await self._upgrade_legacy(digest, legacy)
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

    async def _upgrade_legacy(self, digest: str, legacy: str) -> bytes | str | None:
        """A key stored as plain SHA-256 (before keyed hashing), moved under its
        keyed digest in one transaction: the record, its id's pointer, and the
        old entry removed. None when there is no such key (the usual miss)."""
        moved: bytes | str | None = None
        tries = 0

        async def move(pipe: Pipeline) -> bool:
            nonlocal moved, tries
            tries += 1
            raw = await pipe.get(f"{P}apikey:{legacy}")
            if raw is None:
                # Gone after a retry: another replica moved it first.
                moved = await self._redis.get(f"{P}apikey:{digest}") if tries > 1 else None
                return False
            moved = raw
            # Copied first, then the old entry deleted under WATCH (one slot each
            # on a cluster): a revocation of the old entry meanwhile fails the
            # delete, and the next round copies the revoked record over.
            await self._redis.set(f"{P}apikey:{digest}", raw)
            await self._redis.set(f"{P}keyid:{_key_dec.decode(raw).key_id}", digest)
            _begin(pipe)
            pipe.delete(f"{P}apikey:{legacy}")
            return True

        await _optimistic(self._redis, f"{P}apikey:{legacy}", move)
        return moved

"""WebSocket tickets: a browser's way onto ``/v1/ws`` without its API key in a URL.

``POST /v1/ws/tickets`` (with the key in ``Authorization``) issues a ticket; the
socket presents it once, within ``ttl_s`` (30 s), and acts as that key from then
on. Redis holds, under ``jetserve:wsticket:<SHA-256 of the ticket>``, the API key
sealed with a one-time pad derived from the ticket (SHAKE-256). So a copy of Redis
yields neither a usable ticket nor the key: both need the ticket, which only the
client has. Redemption is one ``GETDEL``: of two sockets presenting the same
ticket, exactly one gets the key.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from redis.exceptions import RedisError

from gateway.errors import Unavailable
from streams.redis_client import RedisClient

PREFIX = "jetserve:wsticket:"
TICKET_PREFIX = "wst-"  # tells a ticket from an API key in a bearer subprotocol
_TICKET = re.compile(r"wst-[A-Za-z0-9_-]{43}")  # the prefix and 32 random bytes
_PAD_LABEL = b"jetserve.wsticket.pad.v1\x00"  # keeps the pad apart from the key hash


def is_ticket(value: str) -> bool:
    return value.startswith(TICKET_PREFIX)


def _key(ticket: str) -> str:
    return PREFIX + hashlib.sha256(ticket.encode()).hexdigest()


def _xor_pad(ticket: str, data: bytes) -> bytes:
    # The ticket is 256 random bits and used once, so its pad never repeats.
    pad = hashlib.shake_256(_PAD_LABEL + ticket.encode()).digest(len(data))
    return bytes(a ^ b for a, b in zip(data, pad, strict=True))


class TicketStore:
    def __init__(self, client: RedisClient, ttl_s: int = 30) -> None:
        self._redis = client
        self.ttl_s = ttl_s

    async def issue(self, api_key: str) -> str:
        """A new ticket for ``api_key`` (already authenticated by the caller)."""
        ticket = TICKET_PREFIX + secrets.token_urlsafe(32)
        sealed = _xor_pad(ticket, api_key.encode()).hex()
        try:
            await self._redis.set(_key(ticket), sealed, ex=self.ttl_s, nx=True)
        except (RedisError, OSError) as exc:
            raise Unavailable("Ticket store unavailable.", code="ticket_store_unavailable") from exc
        return ticket

    async def redeem(self, ticket: str) -> str | None:
        """The API key the ticket was issued for, once; None when it is malformed,
        unknown, expired or already used."""
        if not _TICKET.fullmatch(ticket):
            return None  # never worth a round trip
        try:
            sealed = await self._redis.getdel(_key(ticket))
        except (RedisError, OSError) as exc:
            raise Unavailable("Ticket store unavailable.", code="ticket_store_unavailable") from exc
        if sealed is None:
            return None
        hexed = sealed.decode() if isinstance(sealed, bytes) else str(sealed)
        return _xor_pad(ticket, bytes.fromhex(hexed)).decode(errors="replace")

"""NATS connection helper shared by every process, and its credential.

A process connects as one role (streams/auth.py) with that role's nkey seed,
from ``$JETSERVE_NATS_SEED`` or the file named by ``$JETSERVE_NATS_SEED_FILE``
(never a flag: ``ps`` shows flags). Without one it refuses to start, unless
told ``insecure``: then it connects without a credential and says so loudly.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client

from streams.auth import Role, inbox_prefix
from streams.errors import CredentialError
from streams.secrets import read_secret

log = logging.getLogger(__name__)

SEED_ENV = "JETSERVE_NATS_SEED"


@dataclass(frozen=True)
class BusAuth:
    """How one process authenticates to NATS: its role's nkey seed (None only on
    an insecure bus), its inbox prefix, and optional TLS files."""

    seed: str | None
    inbox: str
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_env(
        cls,
        role: Role,
        *,
        tenant: str | None = None,
        insecure: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> BusAuth:
        seed = read_secret(SEED_ENV)
        if seed is None and not insecure:
            raise CredentialError(
                f"no NATS credential for the {role.value} role: set {SEED_ENV}_FILE "
                f"(or {SEED_ENV}) to its nkey seed (jetserve credentials), "
                "or pass --insecure for an open development bus"
            )
        if seed is None:
            log.warning(
                "INSECURE: the %s connects to NATS without a credential; whoever reaches "
                "NATS can read every tenant's completions and skip keys and budgets",
                role.value,
            )
        return cls(seed, inbox_prefix(role, tenant), tls_ca, tls_cert, tls_key)

    def options(self) -> dict[str, Any]:
        """``nats.connect`` keyword arguments for this credential."""
        opts: dict[str, Any] = {"inbox_prefix": self.inbox}
        if self.seed is not None:
            opts["nkeys_seed_str"] = self.seed
        tls = self.tls()
        if tls is not None:
            opts["tls"] = tls
        return opts

    def tls(self) -> ssl.SSLContext | None:
        if self.tls_ca is None and self.tls_cert is None:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert is not None:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx


OPEN = BusAuth(None, "_INBOX")  # an insecure bus, for code paths that say so


class _Client(Client):
    """nats-py's client, with its PONG handling fixed.

    Each ``flush()`` queues a future for its PING's PONG; a flush cancelled
    (its task stopped) or timed out leaves that future cancelled in the queue,
    and when the PONG arrives nats-py sets a result on it: InvalidStateError,
    which ends the connection's read loop for good: every later flush times
    out and nothing more is received (a worker's shutdown took 5 s for it;
    nats-io/nats.py#624 is the same flaw in the flusher). The PONG still
    answers that PING, so it is consumed, and nobody is told.

    It also tells the process's parts of each reconnect (:func:`when_reconnected`):
    what the server kept meanwhile (a durable mark) may matter now, not at the
    next use."""

    def __init__(self) -> None:
        super().__init__()
        self.reconnect_hooks: list[Callable[[], None]] = []

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


class _SlowConsumers:
    """nats-py reports each message a full subscription drops, from the connection's
    read loop: under a flood a warning per message slowed the loop every
    subscription shares. Counted per subscription, and said at most once per
    ``every_s`` (what is counted after a line, at the end of that interval)."""

    def __init__(self, name: str, every_s: float = 5.0) -> None:
        self._name = name
        self._every_s = every_s
        self._dropped: dict[str, int] = {}
        self._said = float("-inf")
        self._flush: asyncio.TimerHandle | None = None

    def dropped(self, subject: str) -> None:
        self._dropped[subject] = self._dropped.get(subject, 0) + 1
        wait = self._said + self._every_s - time.monotonic()
        if wait <= 0:
            self._say()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(wait, self._say)

    def _say(self) -> None:
        self._flush = None
        if not self._dropped:
            return
        self._said = time.monotonic()
        counts, self._dropped = self._dropped, {}
        log.warning(
            "nats %s: a full subscription dropped messages (slow consumer): %s",
            self._name,
            ", ".join(f"{n} on {s}" for s, n in sorted(counts.items())),
        )


async def connect(url: str, name: str, auth: BusAuth = OPEN) -> Client:
    slow = _SlowConsumers(name)

    async def on_error(exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            # The subscription's subject: a wildcard's messages each have their own.
            slow.dropped(exc.sub.subject if exc.sub is not None else exc.subject)
            return
        log.warning("nats %s: %s", name, exc)

    async def on_disconnect() -> None:
        # Also called on a deliberate close; reconnects are what matter.
        log.info("nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.warning("nats %s: reconnected", name)
        for hook in list(nc.reconnect_hooks):
            hook()

    # A comma-separated list names the nodes of a cluster; any one will do.
    servers = [u.strip() for u in url.split(",") if u.strip()]
    nc = _Client()
    await nc.connect(
        servers,
        name=name,
        max_reconnect_attempts=-1,  # ride out a nats-server restart
        reconnect_time_wait=0.5,  # type: ignore[arg-type]  # annotated int; a sleep, float is fine
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **auth.options(),
    )
    return nc


def when_reconnected(nc: Client, hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook`` (synchronous: start a task for any I/O) after each reconnect
    of ``nc`` (a connection from :func:`connect`), once its subscriptions are back;
    returns what stops it."""
    if not isinstance(nc, _Client):
        raise TypeError("when_reconnected: a connection made by streams.connect.connect")
    hooks = nc.reconnect_hooks
    hooks.append(hook)
    return lambda: hooks.remove(hook) if hook in hooks else None

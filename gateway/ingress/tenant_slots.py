"""Requests in flight per tenant over NATS: a service's connection is not a socket
of ours, so the bound (a WebSocket's is per socket) is per tenant and replica."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from gateway.errors import RateLimited


class TenantSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._inflight: Counter[str] = Counter()

    def enter(self, tenant: str) -> None:
        """Count one more request of ``tenant`` in flight, or refuse it (429)."""
        if self._inflight[tenant] >= self.limit:
            raise RateLimited(
                f"At most {self.limit} requests of a tenant in flight over NATS "
                "on this gateway; wait for one to finish.",
                code="too_many_inflight",
                retry_after=1.0,
            )
        self._inflight[tenant] += 1

    def leave(self, tenant: str) -> None:
        self._inflight[tenant] -= 1
        if not self._inflight[tenant]:
            del self._inflight[tenant]

    @contextlib.contextmanager
    def held(self, tenant: str) -> Iterator[None]:
        self.enter(tenant)
        try:
            yield
        finally:
            self.leave(tenant)

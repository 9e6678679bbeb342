"""Things a tenant holds at once on one gateway replica, bounded: requests in
flight over NATS (a service's connection is not a socket of ours, so the bound,
a WebSocket's per socket, is per tenant and replica), and agent-run event streams
followed (each an ordered consumer on the bus, free of charge)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from gateway.errors import RateLimited

NATS_INFLIGHT = "requests of a tenant in flight over NATS"


class TenantSlots:
    def __init__(
        self, limit: int, what: str = NATS_INFLIGHT, code: str = "too_many_inflight"
    ) -> None:
        self.limit = limit
        self._what = what
        self._code = code
        self._inflight: Counter[str] = Counter()

    def enter(self, tenant: str) -> None:
        """Count one more for ``tenant``, or refuse it (429)."""
        if self._inflight[tenant] >= self.limit:
            raise RateLimited(
                f"At most {self.limit} {self._what} on this gateway; wait for one to finish.",
                code=self._code,
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

"""The canary split of a route contract's rollout (streams/routes.py,
``rollout.canary``; docs/rollout.md).

A request whose class and tenant match the canary is on the canary arm when a
hash of its route and request id falls under the canary's share: the same id
always lands on the same arm (a client retry with an ``Idempotency-Key`` keeps
its id, so it stays on its arm), and raising the share only moves requests from
the stable arm to the canary, never back. A canary-arm request names the canary
deployment as its only candidate; every other request of the route names the
candidates without it, so it never reaches the canary's pool.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from streams.routes import CanaryPolicy, RouteContract

Arm = Literal["", "stable", "canary"]  # "": the request is outside any canary's scope
_SCALE = float(1 << 64)


def position(route: str, request_id: str) -> float:
    """Where a request id falls in [0, 1): the first 8 bytes of a SHA-256."""
    digest = hashlib.sha256(f"{route}\x00{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


def arm(canary: CanaryPolicy | None, route: str, request_id: str, cls: str, tenant: str) -> Arm:
    """The arm of one request: "" when no canary covers its class and tenant."""
    if canary is None or not canary.matches(cls, tenant):
        return ""
    return "canary" if position(route, request_id) < canary.share else "stable"


def candidates(contract: RouteContract, which: Arm) -> list[str]:
    """The deployments a request on ``which`` arm may be served by, in
    preference order (only the first when the route has no fallback)."""
    names = [d.name for d in contract.candidates]
    canary = contract.rollout.canary if contract.rollout is not None else None
    if canary is not None:
        if which == "canary":
            return [canary.candidate]
        names = [n for n in names if n != canary.candidate]
    return names if contract.fallback.enabled else names[:1]

"""The canary split of a route contract's rollout (streams/routes.py,
``rollout.canary``; docs/rollout.md).

A request whose class and tenant match the canary is on the canary arm when a
keyed hash of its route and request id falls under the canary's share: the same
id always lands on the same arm (a client retry with an ``Idempotency-Key`` keeps
its id, so it stays on its arm), and raising the share only moves requests from
the stable arm to the canary, never back. The hash is keyed with a secret every
gateway replica shares (derived from the key secret): an ``Idempotency-Key``
names its request id, so with a plain hash a tenant could pick keys offline that
put its requests on the arm it wants, and steer the rollout guard's judgement
(its errors all on the canary to force a rollback, or all on the stable arm to
hide a failing canary). A canary-arm request names the canary
deployment as its only candidate; every other request of the route names the
candidates without it, so it never reaches the canary's pool.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from streams.routes import CanaryPolicy, RouteContract

Arm = Literal["", "stable", "canary"]  # "": the request is outside any canary's scope
_SCALE = float(1 << 64)


def arms_key(key_secret: bytes) -> bytes:
    """The secret the split is keyed with, from the gateways' key secret (its own
    use of it: API keys are hashed under the key secret itself)."""
    return hmac.new(key_secret, b"jetserve rollout arms", hashlib.sha256).digest()


def position(route: str, request_id: str, key: bytes) -> float:
    """Where a request id falls in [0, 1): the first 8 bytes of an HMAC-SHA-256
    under ``key`` (:func:`arms_key`)."""
    digest = hmac.new(key, f"{route}\x00{request_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


def arm(
    canary: CanaryPolicy | None, route: str, request_id: str, cls: str, tenant: str, key: bytes
) -> Arm:
    """The arm of one request: "" when no canary covers its class and tenant."""
    if canary is None or not canary.matches(cls, tenant):
        return ""
    return "canary" if position(route, request_id, key) < canary.share else "stable"


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

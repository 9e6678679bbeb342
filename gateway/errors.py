"""Errors of the gateway, each rendered in OpenAI's error shape.

GatewayError                 base: HTTP ``status``, OpenAI ``type`` and ``code``, ``retryable``
├── AuthenticationFailed     401 missing or unknown API key
├── PermissionDenied         403 the key may not use this model or class
├── BadRequest               400 malformed body or parameters
├── NotFound                 404 unknown model or route
├── RateLimited              429 queue full / rate limit (carries Retry-After)
├── Unavailable              503 a dependency (NATS, Redis) is down: fail closed
├── UpstreamFailed           502 the engine failed (mapped from an error frame)
└── Timeout                  504 the request's deadline passed
"""

from __future__ import annotations

import math
from typing import Any

import msgspec


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"
    retryable = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> bytes:
        return msgspec.json.encode(self.body())

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        # Rounded up: a client that waits exactly this long is not refused again.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retryable = True


class Unavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"
    retryable = True


class UpstreamFailed(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class Timeout(GatewayError):
    status = 504
    type = "timeout"
    code = "deadline_exceeded"
    retryable = True


_BY_STATUS: dict[int, type[GatewayError]] = {
    400: BadRequest,
    401: AuthenticationFailed,
    403: PermissionDenied,
    404: NotFound,
    429: RateLimited,
    503: Unavailable,
    504: Timeout,
}


def from_frame(status: int, code: str, message: str) -> GatewayError:
    """Map a worker's error frame to the error the client sees."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        # Another 4xx from the engine (422, 413...): the request was bad; our own
        # clients see the statuses we document.
        cls = BadRequest if 400 <= status < 500 else UpstreamFailed
        return cls(message, code=code, status=502 if cls is UpstreamFailed else None)
    return cls(message, code=code)

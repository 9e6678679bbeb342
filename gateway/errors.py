"""Errors of the gateway, each rendered in OpenAI's error shape.

JetserveError (streams.errors)   base: ``message``, ``code``, ``retryable``
└── GatewayError                 base: HTTP ``status``, OpenAI ``type`` and ``code``
    ├── AuthenticationFailed     401 missing or unknown API key
    ├── PermissionDenied         403 the key may not use this model or class
    ├── BadRequest               400 malformed body or parameters
    │   ├── RequestTooLarge      413 over the bus's message size; 400 over a whole
    │   │   │                    minute of ``tpm`` (never admitted: not retryable)
    │   │   └── BodyTooLarge     413 over the gateway's body cap (``--max-body-bytes``);
    │   │                        the connection is closed after the answer
    │   └── HeadersTooLarge      431 too many request headers, or too many bytes of them
    ├── NotFound                 404 unknown model or route
    ├── ResumeWindowExceeded     410 a stream whose start the frames capture no longer holds
    ├── ClientTooSlow            408 the client read the stream too slowly; it was ended
    ├── Conflict                 409 a run id taken or settled; an approval not pending
    │   ├── IdempotencyConflict  409 the key's run ended or was taken meanwhile (retryable)
    │   └── OrgExists            409 an org of that id exists
    ├── RateLimited              429 queue full / rate limit (carries Retry-After;
    │                            a rate limit's exact wait also as retry-after-ms)
    ├── BudgetExceeded           429 ``insufficient_quota``: a budget is spent (not retryable)
    ├── Unavailable              503 a dependency (NATS, Redis) is down: fail closed
    │   └── AccountingUnavailable    503 no answer from the accounting store
    ├── UpstreamFailed           502 the engine failed (mapped from an error frame)
    │   ├── StreamInterrupted    502 part of the response was lost in transit
    │   └── AnswerLost           502 a worker took the request; its answer was lost
    │                            before the first token (retryable: nothing was sent)
    ├── ClientLeft               499 the client left before its request was admitted
    └── Timeout                  504 the request's deadline passed
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec

from streams.errors import JetserveError

if TYPE_CHECKING:
    from gateway.tenancy.limits import Level, LimitKind, Period


class GatewayError(JetserveError):
    status = 500
    type = "server_error"
    code = "internal_error"
    retryable = False
    # The run itself ended with it (a worker's error frame), not this gateway's
    # reading of it: a retry following the run may then release its claim.
    from_run = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.param = param
        self.retry_after = retry_after
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


class RequestTooLarge(BadRequest):
    """413: the request's bytes exceed the bus's message size. From
    :meth:`over_tpm`, 400: its worst-case tokens exceed a whole minute of ``tpm``.
    Either way it can never be admitted, so retrying is pointless."""

    status = 413
    code = "request_too_large"
    level: Level | None = None
    tokens = 0
    tpm = 0

    @classmethod
    def over_tpm(cls, level: Level, tokens: int, tpm: int) -> RequestTooLarge:
        exc = cls(
            f"Request too large: it may use up to {tokens} tokens but the {level} limit "
            f"is {tpm} tokens per minute. Lower max_tokens or shorten the prompt.",
            param="max_tokens",
            status=400,
        )
        exc.level, exc.tokens, exc.tpm = level, tokens, tpm
        return exc


class BodyTooLarge(RequestTooLarge):
    """413 before any work: the body is over the gateway's cap. The answer closes
    the connection, so the rest of the body is never read."""

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class HeadersTooLarge(BadRequest):
    """431 before any work: too many request headers, or too many bytes of them."""

    status = 431
    code = "request_headers_too_large"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ResumeWindowExceeded(GatewayError):
    """A resume (``Last-Event-ID``) of a stream the frames capture keeps only in
    part: its start is gone (oldest first), so the text after the client's event
    cannot be told for sure. Never a partial or wrong text."""

    status = 410
    type = "invalid_request_error"
    code = "resume_window_exceeded"


class ClientTooSlow(GatewayError):
    """Raised into the request when the client reads too slowly, and out of its
    response (the server then closes the connection: the only signal left)."""

    status = 408
    type = "invalid_request_error"
    code = "client_too_slow"


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class OrgExists(Conflict):
    pass


class IdempotencyConflict(Conflict):
    """The run an Idempotency-Key names ended, or was taken, while this retry
    waited to take it over: retry, and the key's next run starts."""

    code = "idempotency_conflict"
    retryable = True


class RateLimited(GatewayError):
    """429 ``rate_limit_exceeded``. From :meth:`over_limit` (a GCRA limit of the
    accountant) ``retry_after_s`` is exact, from the TAT, and is also sent as
    ``retry-after-ms``; a full queue sends ``Retry-After`` only."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retryable = True
    limit: LimitKind | None = None
    level: Level | None = None

    @classmethod
    def over_limit(cls, retry_after_s: float, limit: LimitKind, level: Level) -> RateLimited:
        unit = "requests" if limit == "rpm" else "tokens"
        exc = cls(
            f"Rate limit reached for {unit} per minute ({limit}) at the {level} level. "
            f"Please try again in {retry_after_s:.3f}s.",
            retry_after=retry_after_s,
        )
        exc.limit, exc.level = limit, level
        return exc

    @property
    def retry_after_s(self) -> float:
        return self.retry_after or 0.0

    def headers(self) -> dict[str, str]:
        if self.limit is None:
            return super().headers()
        # Retry-After is whole seconds (at least 1); the openai SDK prefers the
        # exact ``retry-after-ms``.
        return {
            **super().headers(),
            "retry-after-ms": str(max(1, math.ceil(self.retry_after_s * 1000))),
        }


class BudgetExceeded(GatewayError):
    """429 ``insufficient_quota``, like OpenAI's: the openai SDK raises
    ``RateLimitError`` with this message, and ``x-should-retry: false`` stops it
    from retrying into a spent budget."""

    status = 429
    type = "insufficient_quota"
    code = "budget_exceeded"
    retryable = False

    def __init__(
        self,
        level: Level,
        *,
        ident: str = "",
        period: Period = "month",
        budget_micros: int = 0,
        spent_micros: int = 0,
        reserved_micros: int = 0,
        cost_micros: int = 0,
    ) -> None:
        self.level = level
        self.ident = ident
        self.period = period
        self.budget_micros = budget_micros
        self.spent_micros = spent_micros
        self.reserved_micros = reserved_micros
        self.cost_micros = cost_micros
        left = max(0, budget_micros - spent_micros - reserved_micros)
        span = {"day": "today's", "month": "this month's", "total": "the total"}[period]
        super().__init__(
            f"You exceeded your current quota: this request may cost up to "
            f"{_usd(cost_micros)} but only {_usd(left)} of {span} {level} budget of "
            f"{_usd(budget_micros)} is left ({_usd(spent_micros)} spent, "
            f"{_usd(reserved_micros)} held by requests in flight). Raise the budget or "
            f"lower max_tokens."
        )

    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"}


class Unavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"
    retryable = True


class AccountingUnavailable(Unavailable):
    """503: no evidence from the accounting store, so the gateway fails closed."""

    code = "accounting_unavailable"


class UpstreamFailed(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class StreamInterrupted(UpstreamFailed):
    code = "stream_interrupted"


class AnswerLost(UpstreamFailed):
    code = "answer_lost"
    retryable = True


class ClientLeft(GatewayError):
    """499: the client went away before its request was admitted (retryable: it
    was not run)."""

    status = 499
    type = "invalid_request_error"
    code = "client_disconnected"
    retryable = True


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
    err: GatewayError
    if cls is None:
        # Another 4xx from the engine (422, 413...): the request was bad; our own
        # clients see the statuses we document.
        cls = BadRequest if 400 <= status < 500 else UpstreamFailed
        err = cls(message, code=code, status=502 if cls is UpstreamFailed else None)
    else:
        err = cls(message, code=code)
    err.from_run = True
    return err


def _usd(micros: int) -> str:
    return f"${micros / 1_000_000:,.6f}".rstrip("0").rstrip(".") if micros else "$0"

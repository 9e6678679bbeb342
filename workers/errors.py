"""Errors of the worker package.

JetserveError (streams.errors)   base: ``message``, ``code``, ``retryable``
└── WorkerError                  base: adds ``status``, the HTTP status of the error frame
    ├── EngineError              the engine answered with an error or broke
    │   ├── EngineRateLimited    429 (retryable before the first token)
    │   ├── EngineUnavailable    503, 5xx or connect failure (retryable before the first token);
    │   │   │                    the client is told only that (``client_message``)
    │   │   └── EngineUnreachable  no connection to the engine (its message is logged)
    │   ├── EngineRejected       4xx: the request itself is bad (never retried)
    │   │   ├── EngineUnsupported  400 ``unsupported_parameter``: the adapter cannot carry a field
    │   │   └── ResponseTooLarge   400 the answer (embeddings) exceeds the bus's message size
    │   └── EngineStreamBroken   the stream ended without a finish (never retried)
    ├── DeadlineExceeded         the request's absolute deadline passed
    ├── WorkerStopping           it stopped while the request waited for KV blocks (handed back)
    └── TokenizerUnavailable     --tokenizer given, but it cannot be loaded (start-up)

The worker retries an engine call (before the first token) only when the error's
``retryable`` says so (workers/inference/worker.py).
"""

from __future__ import annotations

from streams.errors import JetserveError


class WorkerError(JetserveError):
    code = "internal_error"
    status = 500
    retryable = False

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status

    @property
    def client_message(self) -> str:
        """What the error frame tells the client: the message, unless it may
        hold what is not the client's to see (below)."""
        return self.message


class EngineError(WorkerError):
    code = "engine_error"
    status = 502


class EngineRateLimited(EngineError):
    code = "engine_rate_limited"
    status = 429
    retryable = True


class EngineUnavailable(EngineError):
    """The engine's 5xx, or no engine to talk to. The client is told no more than
    that: a 5xx body may be a proxy's page or a traceback, and a connect error
    names the engine's address (the worker's log has the latter: below)."""

    code = "engine_unavailable"
    status = 503
    retryable = True

    @property
    def client_message(self) -> str:
        return f"The engine is unavailable (HTTP {self.status}); retry later."


class EngineUnreachable(EngineUnavailable):
    """No connection to the engine (refused, reset, timed out, closed): the
    message is the worker's own, the engine's address in it, and is logged."""


class EngineRejected(EngineError):
    code = "invalid_request"
    status = 400


class EngineUnsupported(EngineRejected):
    """The deployment's engine (its adapter) cannot do what a field asks: refused,
    never dropped silently."""

    code = "unsupported_parameter"


class ResponseTooLarge(EngineRejected):
    """The engine answered, but the answer's one frame (all of a request's
    embeddings) is over the bus's message size, or a stream line or whole answer
    is over what a worker reads of an engine (workers/engines/http.py)."""

    code = "response_too_large"
    status = 400


class EngineStreamBroken(EngineError):
    code = "stream_interrupted"
    status = 502


class EngineConnectionLost(EngineStreamBroken):
    """The engine's connection broke under its stream (an engine restarting):
    before the first token, worth one more attempt (workers/inference/worker.py).
    What the engine sent wrong (a malformed chunk, a model's malformed tool call)
    is not: another attempt would most likely send it again."""


class DeadlineExceeded(WorkerError):
    code = "deadline_exceeded"
    status = 504


class WorkerStopping(WorkerError):
    """The worker stopped before this request's KV blocks came free: it is handed
    back at once (``nak``) for another worker, not held through the drain."""

    code = "worker_stopping"
    status = 503
    retryable = True


class TokenizerUnavailable(WorkerError):
    """The local tokenizer asked for (``--tokenizer``) cannot be loaded: the
    ``tokenizers`` package is missing or the file is not a tokenizer. A start-up
    error: the worker does not run with counts it was told to make exactly."""

    code = "tokenizer_unavailable"

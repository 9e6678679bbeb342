"""The one error tree of jetserve, rooted here: streams is the kernel every package imports.

Every error of ours is a :class:`JetserveError`: it carries a ``message``, a
machine ``code`` and ``retryable`` (may the same work, tried again, succeed?),
as a class attribute or, where one class covers both cases, a constructor
argument. Each package's ``errors.py`` draws its own subtree::

    JetserveError (streams/errors.py)
    ├── the kernel's errors, below
    ├── InvalidTenantError        streams/request_ledger.py: not a safe tenant id
    ├── GatewayError              gateway/errors.py: HTTP status and OpenAI error body
    ├── LedgerWriteError          gateway/tenancy/request_ledger.py: the record was not stored
    ├── ToolError                 tools/errors.py: the tool runtime
    ├── WorkerError               workers/errors.py: the inference worker and its engines
    └── AgentError                workers/agent/errors.py: the agent executor

The kernel's own, defined below:

JetserveError                  base: ``code`` and ``retryable`` travel with it
├── ProvisioningError          a stream/consumer could not be created or updated
├── SecretError                a secret's file is named but unreadable or empty
├── CredentialError            a process has no bus credential (and was not told --insecure)
├── PublishError               a request could not be enqueued
│   ├── QueueFullError         the work-queue stream is full (retryable, -> 429)
│   ├── RequestTooLargeError   the request exceeds the bus's message size
│   └── BusUnavailableError    the bus did not take the publish (retryable)
├── ReplyError                 a request's frames ended without a terminal frame
│   ├── DeadlineExceededError  no answer before the request's deadline
│   ├── AnswerLostError        taken off the queue, then silent: the answer was lost (retryable)
│   ├── StreamInterruptedError silence after the first token (retryable)
│   │   └── FramesLostError    tokens lost in transit, and not in the capture
│   └── ReaderTooSlowError     the reader fell a buffer's length behind
└── RunStoreError              the run store (KV) could not be read or written (retryable)
    ├── RunConflictError       a compare-and-set lost: someone else wrote the run first
    ├── RunExistsError         create of a run id that is taken
    ├── RunTooLargeError       the record outgrew the bucket's value limit
    └── LeaseLostError         the run's lease expired and was taken over
"""

from __future__ import annotations


class JetserveError(Exception):
    code = "internal_error"
    retryable = False

    def __init__(
        self, message: str, *, code: str | None = None, retryable: bool | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable


class ProvisioningError(JetserveError):
    code = "provisioning_failed"


class SecretError(JetserveError):
    code = "secret_unreadable"


class CredentialError(JetserveError):
    code = "credential_missing"


class PublishError(JetserveError):
    code = "publish_failed"
    retryable = True


class QueueFullError(PublishError):
    code = "queue_full"
    retryable = True


class RunStoreError(JetserveError):
    code = "run_store_unavailable"
    retryable = True


class RunConflictError(RunStoreError):
    """The record changed since it was read: this writer no longer owns the run."""

    code = "run_conflict"
    retryable = False


class RunExistsError(RunStoreError):
    code = "run_exists"
    retryable = False


class RunTooLargeError(RunStoreError):
    code = "run_too_large"
    retryable = False


class LeaseLostError(RunStoreError):
    code = "lease_lost"
    retryable = False


class RequestTooLargeError(PublishError):
    code = "request_too_large"
    retryable = False


class BusUnavailableError(PublishError):
    code = "bus_unavailable"
    retryable = True


class ReplyError(JetserveError):
    code = "reply_failed"


class DeadlineExceededError(ReplyError):
    code = "deadline_exceeded"


class AnswerLostError(ReplyError):
    """Before the first token: a worker took the request off the work queue and
    no frame of it came for a whole heartbeat timeout after (FrameReader)."""

    code = "answer_lost"
    retryable = True


class StreamInterruptedError(ReplyError):
    code = "stream_interrupted"
    retryable = True


class FramesLostError(StreamInterruptedError):
    """A gap in the tokens that the frames capture could not fill either."""


class ReaderTooSlowError(ReplyError):
    code = "client_too_slow"

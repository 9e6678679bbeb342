"""Errors of the shared kernel.

JetserveError                  base: ``code`` and ``retryable`` travel with it
├── ProvisioningError          a stream/consumer could not be created or updated
├── PublishError               a request could not be enqueued
│   ├── QueueFullError         the work-queue stream is full (retryable, -> 429)
│   └── DuplicateRequestError  same Nats-Msg-Id inside the dedupe window
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

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ProvisioningError(JetserveError):
    code = "provisioning_failed"


class PublishError(JetserveError):
    code = "publish_failed"
    retryable = True


class QueueFullError(PublishError):
    code = "queue_full"
    retryable = True


class DuplicateRequestError(PublishError):
    code = "duplicate_request"
    retryable = False


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

"""Errors of the shared kernel.

JetserveError                  base: ``code`` and ``retryable`` travel with it
├── ProvisioningError          a stream/consumer could not be created or updated
└── PublishError               a request could not be enqueued
    ├── QueueFullError         the work-queue stream is full (retryable, -> 429)
    └── DuplicateRequestError  same Nats-Msg-Id inside the dedupe window
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

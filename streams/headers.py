"""NATS header names that jetserve reads or writes."""

from __future__ import annotations

from enum import StrEnum


class Header(StrEnum):
    MSG_ID = "Nats-Msg-Id"  # JetStream dedupe key: the request id
    TRACEPARENT = "traceparent"
    TRACESTATE = "tracestate"
    DEADLINE = "Jetserve-Deadline"  # absolute unix seconds, mirrors the payload for routing
    DLQ_REASON = "Jetserve-Dlq-Reason"  # why the message was dead-lettered
    DLQ_SOURCE = "Jetserve-Dlq-Source"  # the subject it came on
    DLQ_SEQ = "Jetserve-Dlq-Seq"  # its sequence in the source stream, when it had one
    # On a route's delete marker: the revision it deleted, so the next apply
    # numbers on from the marker alone (never from a history read).
    ROUTE_REVISION = "Jetserve-Route-Revision"

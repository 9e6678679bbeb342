"""Dead letters: a message that cannot be processed is kept, with the reason,
in the ``JETSERVE_DLQ`` stream, and the consumer carries on. Nothing is dropped
silently."""

from __future__ import annotations

import logging

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError

from streams.headers import Header
from streams.subjects import dlq_subject

log = logging.getLogger(__name__)

MAX_REASON = 512


async def dead_letter(
    js: JetStreamContext, source: str, data: bytes, reason: str, seq: int | None = None
) -> bool:
    """Store ``data`` for inspection; False (and a log line) if even that failed."""
    headers = {Header.DLQ_REASON.value: reason[:MAX_REASON], Header.DLQ_SOURCE.value: source}
    if seq is not None:
        headers[Header.DLQ_SEQ.value] = str(seq)
    # The reason stays with the message, not in the log: it may quote an engine's
    # error, and an engine may echo the prompt in it (no prompt text in logs).
    try:
        await js.publish(dlq_subject(source), data, headers=headers, timeout=5.0)
    except (APIError, nats.errors.Error, TimeoutError) as exc:
        log.error("dead-lettering a message from %s (seq %s) failed: %r", source, seq, exc)
        return False
    log.warning(
        "dead-lettered a message from %s (seq %s); its reason is in its headers", source, seq
    )
    return True

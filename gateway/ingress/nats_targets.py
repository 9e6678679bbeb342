"""Where the NATS ingress may publish for a caller: only the caller's own inbox.

The gateway publishes with its own (broad) credential, so a subject the caller
names is a confused deputy waiting: ``$JS.API.STREAM.DELETE.X`` as a reply
subject, ``jetserve.req.batch`` as ``Jetserve-Stream-To``. Both must be under
the service inbox of the tenant the caller's key belongs to
(``_INBOX.tenant.<tenant>.``; streams/auth.py), which the NATS server lets only
that tenant's service credential subscribe to.
"""

from __future__ import annotations

import re

from gateway.errors import PermissionDenied
from streams.auth import tenant_of_inbox

# Literal tokens only: no wildcards, no empty tokens, no whitespace or controls.
_SUBJECT = re.compile(r"[A-Za-z0-9_\-$]+(\.[A-Za-z0-9_\-$]+)*")
MAX_SUBJECT = 256


class NotOwnInbox(PermissionDenied):
    """A target outside the caller's tenant inbox."""

    code = "reply_target_forbidden"


def inbox_tenant(subject: str | None) -> str | None:
    """The tenant whose service inbox ``subject`` is, or None (not one, or not
    a literal subject)."""
    if not subject or len(subject) > MAX_SUBJECT or not _SUBJECT.fullmatch(subject):
        return None
    return tenant_of_inbox(subject)


def check_target(subject: str, tenant: str, what: str) -> None:
    """Refuse ``subject`` unless it is an inbox of ``tenant``'s services."""
    if inbox_tenant(subject) != tenant:
        raise NotOwnInbox(
            f"{what} must be an inbox of your own tenant (_INBOX.tenant.{tenant}.…); "
            "connect with that inbox prefix (docs/security.md)."
        )

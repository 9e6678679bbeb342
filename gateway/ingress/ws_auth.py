"""Who a WebSocket is, decided before it is accepted, and the tickets browsers use.

A socket's credential, the first of:

1. ``Authorization: Bearer <key>`` on the upgrade (non-browser clients);
2. the subprotocol ``jetserve.bearer.<key or ticket>``, offered together with
   ``jetserve.v1``: the server answers with ``jetserve.v1`` and never echoes the
   secret one (browsers can set subprotocols, not headers);
3. ``?ticket=<ticket>``: single-use and short-lived, so a ticket in a URL (proxy
   logs, history) is spent or expired before anyone could replay it;
4. ``?api_key=<key>`` only with ``--ws-allow-query-key``. Without it, a socket that
   sends one is refused even if it also has a good credential: a key in a URL is
   leaked already, and a client should learn that at once.

Every refusal happens before the upgrade is accepted (a 401 with an OpenAI-style
error body); a socket with no credential at all costs no Redis round trip.
"""

from __future__ import annotations

from typing import NamedTuple

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from gateway.errors import AuthenticationFailed, BadRequest
from gateway.inference.service import InferenceService
from gateway.tenancy.tickets import TicketStore, is_ticket
from gateway.web import json_response

PROTOCOL = "jetserve.v1"
BEARER_PROTOCOL = "jetserve.bearer."


class SocketAuth(NamedTuple):
    authorization: str  # "Bearer <key>": every request on the socket is authorised with it
    subprotocol: str | None  # what the accept names (never a secret)
    tenant: str  # the key's, for the socket's log lines


async def issue_ticket(request: Request) -> Response:
    """``POST /v1/ws/tickets``: a single-use ticket for the caller's own key."""
    gw: InferenceService = request.app.state.gateway
    authorization = request.headers.get("authorization")
    await gw.tenancy.authenticate(authorization)
    assert authorization is not None  # authenticate refuses a missing one
    tickets: TicketStore = request.app.state.tickets
    ticket = await tickets.issue(authorization[7:].strip())
    return json_response(
        {"ticket": ticket, "expires_in": tickets.ttl_s}, headers={"Cache-Control": "no-store"}
    )


async def authenticate_socket(ws: WebSocket, allow_query_key: bool) -> SocketAuth:
    gw: InferenceService = ws.app.state.gateway
    tickets: TicketStore = ws.app.state.tickets
    query = ws.query_params
    if "api_key" in query and not allow_query_key:
        raise AuthenticationFailed(
            "'?api_key=' is disabled on this gateway (keys in URLs leak): use a ticket "
            "from POST /v1/ws/tickets, the 'jetserve.bearer.' subprotocol, or an "
            "Authorization header.",
            code="query_key_disabled",
        )
    offered: list[str] = ws.scope.get("subprotocols", [])
    bearer = [p[len(BEARER_PROTOCOL) :] for p in offered if p.startswith(BEARER_PROTOCOL)]
    subprotocol = PROTOCOL if PROTOCOL in offered else None
    if bearer and subprotocol is None:
        # The accept must name an offered subprotocol, and never the secret one.
        raise BadRequest(f"Offer the subprotocol '{PROTOCOL}' along with '{BEARER_PROTOCOL}…'.")
    authorization = ws.headers.get("authorization")
    if authorization is None:
        query_key = query.get("api_key") if allow_query_key else None
        key = await _key(tickets, bearer, query.get("ticket"), query_key)
        authorization = f"Bearer {key}"
    record = await gw.tenancy.authenticate(authorization)
    return SocketAuth(authorization, subprotocol, record.tenant)


async def _key(
    tickets: TicketStore, bearer: list[str], ticket: str | None, query_key: str | None
) -> str:
    """The API key of a socket without an Authorization header."""
    if bearer and not is_ticket(bearer[0]):
        return bearer[0]
    ticket = bearer[0] if bearer else ticket
    if ticket is not None:
        key = await tickets.redeem(ticket)
        if key is None:
            raise AuthenticationFailed(
                "Unknown, expired or already used ticket.", code="invalid_ticket"
            )
        return key
    if query_key is not None:
        return query_key
    raise AuthenticationFailed(
        "Missing credential: send a ticket (POST /v1/ws/tickets) as '?ticket=' or in the "
        "'jetserve.bearer.' subprotocol, or 'Authorization: Bearer <key>'."
    )

"""The admin API (control plane): its own port, its own credential.

Tenants, keys, limits, spend and the ledger of any tenant. Every route needs
``Authorization: Bearer <admin token>``; a gateway started without an admin
token refuses every admin call (fail closed).

Handlers are module functions; the runtime and the token digest live on
``app.state`` (set by :func:`create_admin_app`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Literal, TypeVar

import msgspec
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import web
from gateway.admin.rollout_status import ROLLOUT_STATUS_ROUTES
from gateway.admin.route_contracts import ROUTE_CONTRACT_ROUTES, Handler
from gateway.admin.route_evidence import EVIDENCE_ROUTES
from gateway.admin.route_rollback import ROLLBACK_ROUTES
from gateway.decoding import decode_body
from gateway.errors import AuthenticationFailed, BadRequest, GatewayError, Unavailable
from gateway.runtime import Runtime
from gateway.tenancy.accounting import Accountant, LimitSpec
from gateway.tenancy.keys import KeyRecord, Scopes, Tenancy
from gateway.tenancy.limits import SHADOW_TENANT, Scope
from streams.request_ledger import InvalidTenantError

T = TypeVar("T")
Level = Literal["org", "tenant", "key"]


class NewTenant(msgspec.Struct):
    id: str
    org: str = ""
    name: str = ""


class NewKey(msgspec.Struct):
    tenant: str
    name: str = ""
    # ``scopes.actions``: "inference" (the default) and/or "approve".
    scopes: Scopes = Scopes()
    # An operator-chosen key (demos, migrations), at least MIN_KEY_CHARS long;
    # by default one is generated.
    api_key: str | None = None


class Limits(msgspec.Struct):
    budget_micros: int | None = None
    period: Literal["day", "month", "total"] = "month"
    rpm: int | None = None
    tpm: int | None = None
    weight: float | None = None


def _key_view(record: KeyRecord) -> dict[str, Any]:
    return msgspec.to_builtins(record)  # type: ignore[no-any-return]


def _limits_view(spec: LimitSpec) -> dict[str, Any]:
    return {
        "budget_micros": spec.budget_micros,
        "period": spec.period,
        "rpm": spec.rpm,
        "tpm": spec.tpm,
        "weight": spec.weight,
    }


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.rt
    return rt


def _tenancy(request: Request) -> Tenancy:
    return _runtime(request).gateway.tenancy


def _accountant(request: Request) -> Accountant:
    return _runtime(request).gateway.accountant


def guarded(handler: Handler) -> Handler:
    """The admin credential, then the store failures a handler may raise."""

    async def wrapped(request: Request) -> Response:
        token_sha256: str | None = request.app.state.admin_token_sha256
        given = request.headers.get("authorization", "")
        digest = hashlib.sha256(given[7:].strip().encode()).hexdigest()
        ok = (
            token_sha256 is not None
            and given.lower().startswith("bearer ")
            and hmac.compare_digest(digest, token_sha256)
        )
        if not ok:
            raise AuthenticationFailed("Admin credential required.", code="invalid_admin_token")
        try:
            return await handler(request)
        except (RedisError, OSError) as exc:
            raise Unavailable("The control-plane store (Redis) is unavailable.") from exc
        except InvalidTenantError as exc:
            raise BadRequest(str(exc), param="tenant") from exc

    return wrapped


async def create_tenant(request: Request) -> Response:
    body = decode_body(await request.body(), NewTenant)
    if SHADOW_TENANT in (body.id, body.org):
        raise BadRequest(
            f"'{SHADOW_TENANT}' is the operator tenant of shadow copies; it cannot be created.",
            code="reserved_id",
            param="id",
        )
    tenant = await _tenancy(request).create_tenant(body.id, body.org or body.id, body.name)
    return web.json_response(msgspec.to_builtins(tenant), 201)


async def list_tenants(request: Request) -> Response:
    tenants = await _tenancy(request).list_tenants()
    return web.json_response({"data": msgspec.to_builtins(tenants)})


async def show_tenant(request: Request) -> Response:
    tenancy, accountant = _tenancy(request), _accountant(request)
    tenant = await tenancy.get_tenant(request.path_params["tenant"])
    limits = await accountant.get_limits("tenant", tenant.id, org=tenant.org)
    spent, reserved = await accountant.spend("tenant", tenant.id, org=tenant.org)
    keys = await tenancy.list_keys(tenant.id)
    return web.json_response(
        {
            **msgspec.to_builtins(tenant),
            "limits": _limits_view(limits),
            "spent_micros": spent,
            "reserved_micros": reserved,
            "keys": [_key_view(k) for k in keys],
        }
    )


async def create_key(request: Request) -> Response:
    body = decode_body(await request.body(), NewKey)
    # Tenancy.create_key refuses a chosen key under MIN_KEY_CHARS and unknown actions.
    key, record = await _tenancy(request).create_key(
        body.tenant, name=body.name, scopes=body.scopes, plaintext=body.api_key
    )
    return web.json_response({"api_key": key, "key": _key_view(record)}, 201)


async def list_keys(request: Request) -> Response:
    tenant = request.query_params.get("tenant")
    if not tenant:
        raise BadRequest("'tenant' is required.", param="tenant")
    keys = await _tenancy(request).list_keys(tenant)
    return web.json_response({"data": [_key_view(k) for k in keys]})


async def rotate_key(request: Request) -> Response:
    accountant = _accountant(request)

    async def carry(old: KeyRecord, new: KeyRecord) -> None:
        # The key's own limits go with it: they are kept by key id, and a rotated
        # key had none (a key held at a budget of 0 went on spending). Its spend
        # this period starts anew; the tenant's and org's go on.
        limits = await accountant.get_limits("key", old.key_id, org=old.org)
        await accountant.set_limits("key", new.key_id, limits, org=new.org)

    key, record = await _tenancy(request).rotate_key(request.path_params["key_id"], carry)
    return web.json_response({"api_key": key, "key": _key_view(record)}, 201)


async def revoke_key(request: Request) -> Response:
    """Revoke the key, then stop the agent runs it started (a rotation keeps
    them: the old key is retired, not compromised)."""
    record = await _tenancy(request).revoke_key(request.path_params["key_id"])
    runs = _runtime(request).runs
    stopped = await runs.key_revoked(record.key_id) if runs is not None else 0
    return web.json_response({"key": _key_view(record), "runs_cancelled": stopped})


def _level_of(request: Request) -> tuple[Level, str]:
    level = request.path_params["level"]
    if level not in ("org", "tenant", "key"):
        raise BadRequest("level must be org, tenant or key.", param="level")
    return level, request.path_params["ident"]


async def _org_of(request: Request, level: Level, ident: str, *, writing: bool) -> str:
    """The org whose accounting slot holds ``level``/``ident``. A tenant or key
    that does not exist is a 404, and so is an org being written: limits for it
    would silently never apply. The operator tenant of shadow copies is built
    in: its own org and key."""
    tenancy = _tenancy(request)
    if ident == SHADOW_TENANT:
        return SHADOW_TENANT
    if level == "tenant":
        return (await tenancy.get_tenant(ident)).org
    if level == "org":
        return (await tenancy.get_org(ident)).id if writing else ident
    return Scope.of(await tenancy.get_key(ident)).org


async def put_limits(request: Request) -> Response:
    level, ident = _level_of(request)
    org = await _org_of(request, level, ident, writing=True)
    body = decode_body(await request.body(), Limits)
    try:
        spec = LimitSpec(body.budget_micros, body.period, body.rpm, body.tpm, body.weight)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    await _accountant(request).set_limits(level, ident, spec, org=org)
    return web.json_response(_limits_view(spec))


async def get_limits(request: Request) -> Response:
    level, ident = _level_of(request)
    org = await _org_of(request, level, ident, writing=False)
    accountant = _accountant(request)
    spec = await accountant.get_limits(level, ident, org=org)
    await _runtime(request).gateway.settlements.flush()  # this replica's answered requests
    spent, reserved = await accountant.spend(level, ident, org=org)
    return web.json_response(
        {**_limits_view(spec), "spent_micros": spent, "reserved_micros": reserved}
    )


async def ledger(request: Request) -> Response:
    tenant = request.query_params.get("tenant")
    if not tenant:
        raise BadRequest("'tenant' is required.", param="tenant")
    since, until, limit = web.ledger_window(request)
    rt = _runtime(request)
    reader = rt.ledger_reader
    await rt.gateway.settlements.flush()  # this replica's answered requests are in it
    return await web.ledger_lines(reader.query(tenant, since, until, limit))


async def healthz(request: Request) -> Response:
    return web.json_response({"status": "ok"})


# (path, method, handler); every one but the health check needs the credential.
ADMIN_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("/admin/tenants", "POST", create_tenant),
    ("/admin/tenants", "GET", list_tenants),
    ("/admin/tenants/{tenant}", "GET", show_tenant),
    ("/admin/keys", "POST", create_key),
    ("/admin/keys", "GET", list_keys),
    ("/admin/keys/{key_id}/rotate", "POST", rotate_key),
    ("/admin/keys/{key_id}/revoke", "POST", revoke_key),
    ("/admin/limits/{level}/{ident}", "PUT", put_limits),
    ("/admin/limits/{level}/{ident}", "GET", get_limits),
    ("/admin/ledger", "GET", ledger),
    # Before the contract routes, whose {name:path} takes any suffix.
    *ROLLBACK_ROUTES,
    *ROLLOUT_STATUS_ROUTES,
    *EVIDENCE_ROUTES,
    *ROUTE_CONTRACT_ROUTES,
)


def create_admin_app(rt: Runtime, token_sha256: str | None) -> Starlette:
    routes = [Route("/admin/healthz", healthz, methods=["GET"])]
    routes += [Route(path, guarded(h), methods=[method]) for path, method, h in ADMIN_ROUTES]
    app = Starlette(
        routes=routes,
        exception_handlers={GatewayError: web.on_gateway_error, HTTPException: web.on_http_error},
    )
    app.state.rt = rt
    app.state.admin_token_sha256 = token_sha256
    return app

"""A small client of the gateway's admin API, for the CLI, ``jetserve up`` and tests."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx


class AdminError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"admin API answered {status}: {body}")
        self.status = status


class AdminClient:
    def __init__(self, base_url: str, token: str, timeout: float = 10.0) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            raise AdminError(r.status_code, r.text)
        if r.headers.get("content-type", "").startswith("application/x-ndjson"):
            return r.text
        return r.json()

    def create_tenant(self, tenant: str, org: str = "", name: str = "") -> dict[str, Any]:
        return dict(
            self._call("POST", "/admin/tenants", json={"id": tenant, "org": org, "name": name})
        )

    def list_tenants(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/admin/tenants")["data"])

    def show_tenant(self, tenant: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/admin/tenants/{tenant}"))

    def create_key(
        self,
        tenant: str,
        name: str = "",
        scopes: dict[str, list[str]] | None = None,
        api_key: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"tenant": tenant, "name": name}
        if scopes:
            body["scopes"] = scopes
        if api_key:
            body["api_key"] = api_key
        return dict(self._call("POST", "/admin/keys", json=body))

    def list_keys(self, tenant: str) -> list[dict[str, Any]]:
        return list(self._call("GET", "/admin/keys", params={"tenant": tenant})["data"])

    def rotate_key(self, key_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/admin/keys/{key_id}/rotate"))

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/admin/keys/{key_id}/revoke"))

    def set_limits(self, level: str, ident: str, **limits: Any) -> dict[str, Any]:
        return dict(self._call("PUT", f"/admin/limits/{level}/{ident}", json=limits))

    def get_limits(self, level: str, ident: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/admin/limits/{level}/{ident}"))

    def ledger(self, tenant: str, since: float | None = None, until: float | None = None) -> str:
        params: dict[str, Any] = {"tenant": tenant}
        if since is not None:
            params["since"] = since
        if until is not None:
            params["until"] = until
        text: str = self._call("GET", "/admin/ledger", params=params)
        return text

    # -- route contracts ----------------------------------------------------------
    def apply_route(
        self, contract: dict[str, Any], expected_revision: int | None = None, actor: str = ""
    ) -> dict[str, Any]:
        """PUT the contract; the answer's ``changed`` says whether a revision was made."""
        body = dict(contract)
        if expected_revision is not None:
            body["expected_revision"] = expected_revision
        headers = {"X-Jetserve-Actor": actor} if actor else {}
        name = quote(str(contract.get("name", "")), safe="/")
        return dict(self._call("PUT", f"/admin/routes/{name}", json=body, headers=headers))

    def list_routes(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/admin/routes")["data"])

    def show_route(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/admin/routes/{quote(name, safe='/')}"))

    def route_history(self, name: str) -> list[dict[str, Any]]:
        return list(self._call("GET", f"/admin/routes/{quote(name, safe='/')}/history")["data"])

    def route_diff(
        self, name: str, from_rev: int | None = None, to_rev: int | None = None
    ) -> dict[str, Any]:
        params = {k: v for k, v in (("from", from_rev), ("to", to_rev)) if v is not None}
        return dict(self._call("GET", f"/admin/routes/{quote(name, safe='/')}/diff", params=params))

    def rollback_route(
        self, name: str, to: int | None = None, reason: str = "", actor: str = ""
    ) -> dict[str, Any]:
        """A new revision restoring ``to`` (default: the previous contract)."""
        body: dict[str, Any] = {"reason": reason}
        if to is not None:
            body["to"] = to
        headers = {"X-Jetserve-Actor": actor} if actor else {}
        path = f"/admin/routes/{quote(name, safe='/')}/rollback"
        return dict(self._call("POST", path, json=body, headers=headers))

    def route_status(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/admin/routes/{quote(name, safe='/')}/status"))

    def route_evidence(self, name: str, revision: int | None = None) -> dict[str, Any]:
        params = {} if revision is None else {"revision": revision}
        path = f"/admin/routes/{quote(name, safe='/')}/evidence"
        return dict(self._call("GET", path, params=params))

    def attach_evidence(self, name: str, evidence: dict[str, Any]) -> dict[str, Any]:
        path = f"/admin/routes/{quote(name, safe='/')}/evidence"
        return dict(self._call("PUT", path, json=evidence))

    def delete_route(self, name: str, expected_revision: int | None = None) -> dict[str, Any]:
        params = {} if expected_revision is None else {"expected_revision": expected_revision}
        return dict(self._call("DELETE", f"/admin/routes/{quote(name, safe='/')}", params=params))

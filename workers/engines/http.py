"""The HTTP plumbing every engine adapter shares: one pooled client per
adapter, the health probe and the metrics scrape."""

from __future__ import annotations

import httpx

PROBE_TIMEOUT_S = 2.0


def engine_client(
    base_url: str,
    api_key: str | None = None,
    *,
    max_connections: int = 256,
    connect_timeout: float = 5.0,
) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
        # Reads may legitimately wait long (queued in the engine); the request's
        # deadline bounds the whole call instead.
        timeout=httpx.Timeout(connect=connect_timeout, read=None, write=30.0, pool=30.0),
    )


async def probe(client: httpx.AsyncClient, path: str) -> bool:
    """Whether the engine answers ``path`` with 200 (readiness)."""
    try:
        response = await client.get(path, timeout=PROBE_TIMEOUT_S)
    except httpx.TransportError:
        return False
    return response.status_code == 200


async def scrape(client: httpx.AsyncClient, url: str) -> str | None:
    """The engine's Prometheus text, or None when it cannot be read now."""
    try:
        response = await client.get(url, timeout=PROBE_TIMEOUT_S)
    except httpx.TransportError:
        return None
    return response.text if response.status_code == 200 else None

"""Helpers for tests that run the simulator as its own process."""

from __future__ import annotations

import asyncio

import httpx


async def healthy(proc: asyncio.subprocess.Process, client: httpx.AsyncClient) -> bool:
    """The process answers /health (one that exited fails at once, not at the bound)."""
    assert proc.returncode is None, f"the simulator exited ({proc.returncode})"
    try:
        return (await client.get("/health")).status_code == 200
    except httpx.TransportError:
        return False

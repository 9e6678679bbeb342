"""The engine's prefix cache is the tenant's own (``cache_scope``, salted into the
engine's ``cache_salt`` by the worker): one tenant cannot learn from
``cached_tokens`` or first-token delay what another tenant sent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.prompts import chat

pytestmark = [pytest.mark.connected, pytest.mark.timeout(120)]


async def test_another_tenants_prefix_is_not_cached_for_me(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Lanes kept tenants' prefixes apart only in where they ran: on one engine,
    another tenant's probe with the victim's system prompt got cached_tokens 128,
    a wrong guess 0. The same tenant's own prefix is still reused."""
    fleet = make_fleet(workers=1)
    with fleet.admin() as admin:
        admin.create_tenant("attacker")
        attacker = admin.create_key("attacker")["api_key"]

    async def cached(c: httpx.AsyncClient, key: str, body: dict[str, Any]) -> int:
        r = await c.post(
            f"{fleet.base_url}/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    def probe(group: int) -> dict[str, Any]:
        body: dict[str, Any] = dict(chat(group, 99))  # the group's system prompt
        messages = list(body["messages"])
        messages[0] = {**messages[0], "content": messages[0]["content"] + " Variant 0."}
        return {**body, "messages": messages}

    async with httpx.AsyncClient(timeout=30) as c:
        await cached(c, fleet.api_key, chat(7, 0))  # the victim's system prompt
        assert await cached(c, attacker, probe(7)) == 0  # a right guess: no hit
        assert await cached(c, attacker, probe(8)) == 0  # a wrong guess: none either
        assert await cached(c, fleet.api_key, probe(7)) > 0  # its own prefix: reused

"""What an engine serves, from its OpenAI-compatible ``/v1/models``: its base
model ids and its LoRA adapters (vLLM lists an adapter with ``parent``, its base
model). Read at a worker's start and again while it runs: vLLM loads and
unloads adapters at run time (``/v1/load_lora_adapter``)."""

from __future__ import annotations

import httpx

from streams.membership import Adapter
from workers.engines.http import PROBE_TIMEOUT_S

Served = tuple[tuple[str, ...], tuple[Adapter, ...]]


def parse_cards(cards: list[dict[str, object]] | None) -> Served:
    """The base model ids and the adapters in ``/v1/models`` cards."""
    models, adapters = [], []
    for card in cards or ():
        name, parent = str(card["id"]), card.get("parent")
        if parent and parent != name:
            adapters.append(Adapter(name, str(parent)))
        else:
            models.append(name)
    return tuple(models), tuple(adapters)


async def read_served(client: httpx.AsyncClient) -> Served | None:
    """``/v1/models`` parsed; None when the engine cannot say now."""
    try:
        response = await client.get("/v1/models", timeout=PROBE_TIMEOUT_S)
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.TransportError, ValueError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
    return parse_cards(cards)

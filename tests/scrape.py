"""Reading Prometheus metrics the way an operator's scraper does: over HTTP,
from each process's own metrics port."""

from __future__ import annotations

import re
from collections.abc import Iterable

import httpx


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in an exposition ``text`` whose labels
    include ``labels`` (no labels: every sample)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def fleet_sum(urls: Iterable[str], name: str, **labels: str) -> float:
    """:func:`metric_sum` over every process that answers (a killed one does not)."""
    total = 0.0
    async with httpx.AsyncClient(timeout=5) as c:
        for url in urls:
            try:
                text = (await c.get(url)).text
            except httpx.TransportError:
                continue
            total += metric_sum(text, name, **labels)
    return total

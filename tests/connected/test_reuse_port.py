"""Scale up on one node (issue 14): several gateway processes bind one public port
with SO_REUSEPORT, and the kernel spreads new connections over them. Each answers
on its own runtime; the client sees one address."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.scrape import metric_sum

pytestmark = pytest.mark.connected

BODY = {"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def served(text: str) -> float:
    return metric_sum(text, "jetserve_gateway_requests_total", outcome="ok")


async def test_two_gateways_share_one_port_and_both_serve(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(gateways=2, workers=1, gateways_share_port=True)
    assert fleet.gateway_ports[0] == fleet.gateway_ports[1]
    url = f"{fleet.base_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    per_gateway = [0.0, 0.0]
    sent = 0
    # A new connection per request: the kernel picks a process per connection,
    # by a hash of its addresses, so both are reached within a few tries
    # (all 200 on one process would be a 2**-199 draw, or a port not shared).
    while min(per_gateway) == 0 and sent < 200:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(url, json=BODY, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
            sent += 1
            per_gateway = [served((await c.get(m)).text) for m in fleet.gateway_metrics_urls[:2]]
    assert min(per_gateway) > 0, f"one process took every connection: {per_gateway}"
    assert sum(per_gateway) == sent


async def test_a_port_taken_without_reuse_fails_the_second_gateway_at_once(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Without --reuse-port the second bind is refused: sharing is opt-in, and a
    # stray second gateway on a port cannot silently take half its connections.
    fleet = make_fleet(gateways=1, workers=0)
    fleet.spec.gateway_args = ["--port", str(fleet.gateway_port)]
    gw = fleet.start_gateway(wait=False)
    assert gw.proc.wait(30) != 0

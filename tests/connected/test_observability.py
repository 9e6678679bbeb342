"""Metrics (checked by promtool), trace context end to end, worker readiness."""

from __future__ import annotations

import httpx
import pytest

from jetserve.fleet import Fleet
from tests.scrape import promtool_check

pytestmark = pytest.mark.connected

BODY = {"model": "sim-8b", "max_tokens": 6, "messages": [{"role": "user", "content": "trace me"}]}


def test_traceparent_crosses_gateway_nats_worker_engine(fleet: Fleet) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    incoming = f"00-{trace}-00f067aa0ba902b7-01"
    r = httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {fleet.api_key}", "traceparent": incoming},
    )
    assert r.status_code == 200
    returned = r.headers["traceparent"]
    assert returned.split("-")[1] == trace  # same trace ...
    assert returned != incoming  # ... our own span under it
    rec = httpx.get(f"{fleet.sim_url}/sim/requests/{r.headers['x-request-id']}").json()
    engine = rec["traceparent"].split("-")
    assert engine[1] == trace  # the engine call is in the same trace ...
    assert rec["traceparent"] != returned  # ... under the worker attempt's own span


def test_new_trace_when_none_or_malformed(fleet: Fleet) -> None:
    for bad in (None, "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"):
        headers = {"Authorization": f"Bearer {fleet.api_key}"}
        if bad:
            headers["traceparent"] = bad
        r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=BODY, headers=headers)
        tp = r.headers["traceparent"].split("-")
        assert len(tp) == 4
        assert len(tp[1]) == 32
        assert tp[1] != "0" * 32


def test_worker_metrics_and_readiness(fleet: Fleet) -> None:
    httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {fleet.api_key}"},
    ).raise_for_status()
    texts = [httpx.get(f"http://127.0.0.1:{p}/metrics").text for p in fleet.worker_metrics_ports]
    joined = "\n".join(texts)
    assert 'jetserve_worker_requests_total{cls="interactive",outcome="ok"}' in joined
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in joined
    assert "gen_ai_server_time_per_output_token_seconds_bucket" in joined
    assert "jetserve_worker_kv_headroom_ratio" in joined
    assert "process_cpu_seconds_total" in joined  # what workers are scaled by, per process
    assert "trace me" not in joined
    for port in fleet.worker_metrics_ports:
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
        assert ready == {"ready": True, "checks": {"nats": True, "engine": True}}


def test_metrics_pass_promtool(fleet: Fleet) -> None:
    sources = [fleet.gateway_metrics_urls[0]] + [
        f"http://127.0.0.1:{p}/metrics" for p in fleet.worker_metrics_ports
    ]
    for url in sources:
        promtool_check(httpx.get(url).text)


def test_gateway_metrics_cover_the_stages_with_low_cardinality(fleet: Fleet) -> None:
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    for _ in range(2):
        httpx.post(
            f"{fleet.base_url}/v1/chat/completions", json=BODY, headers=headers
        ).raise_for_status()
    text = httpx.get(fleet.gateway_metrics_urls[0]).text
    for needle in (
        'jetserve_gateway_tenant_requests_total{outcome="ok",tenant="other"}',
        "jetserve_gateway_time_per_output_token_seconds_bucket",
        'jetserve_consumer_pending{cls="batch"}',
        'jetserve_consumer_ack_pending{cls="interactive"}',
        'jetserve_queue_depth{cls="embed"}',
        "process_cpu_seconds_total",  # a gateway process's CPU: add one per core near it
    ):
        assert needle in text, needle
    assert fleet.spec.tenant not in text  # not allow-listed: no tenant name in metrics
    assert "x-request-id" not in text.lower()

"""The official openai SDK, unchanged, against a real fleet:
nats-server + redis-server + simulator + gateway + 2 workers, all processes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about message queues and GPUs."},
]


_clients: list[openai.OpenAI] = []  # closed after each test (autouse fixture below)


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    # A client left to the collector closes its sockets whenever it runs: a
    # ResourceWarning in some later test (it was in test_tenancy's budget race).
    yield
    while _clients:
        _clients.pop().close()


def client(fleet: Fleet, key: str | None = None) -> openai.OpenAI:
    c = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key=key or fleet.api_key, max_retries=0)
    _clients.append(c)
    return c


def engine_text(fleet: Fleet, body: dict[str, object]) -> dict[str, object]:
    """The same request straight to the simulator: the reference answer."""
    r = httpx.post(
        f"{fleet.sim_url}/v1/chat/completions", json={**body, "stream": False}, timeout=10
    )
    r.raise_for_status()
    out: dict[str, object] = r.json()
    return out


def test_chat_non_streaming(fleet: Fleet) -> None:
    resp = client(fleet).chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=40)
    ref = engine_text(fleet, {"model": "sim-8b", "messages": MESSAGES, "max_tokens": 40})
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["choices"][0]["message"]["content"]  # type: ignore[index]
    assert choice.finish_reason == ref["choices"][0]["finish_reason"]  # type: ignore[index]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == ref["usage"]["prompt_tokens"]  # type: ignore[index]
    assert resp.usage.completion_tokens == ref["usage"]["completion_tokens"]  # type: ignore[index]
    assert resp.id.startswith("chatcmpl-")


def test_chat_streaming_reassembles_exactly(fleet: Fleet) -> None:
    body = {"model": "sim-8b", "messages": MESSAGES, "max_tokens": 64}
    stream = client(fleet).chat.completions.create(
        model="sim-8b",
        messages=MESSAGES,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    finish = None
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    ref = engine_text(fleet, body)
    assert "".join(parts) == ref["choices"][0]["message"]["content"]  # type: ignore[index]
    assert finish == ref["choices"][0]["finish_reason"]  # type: ignore[index]
    assert usage is not None
    assert usage.completion_tokens == ref["usage"]["completion_tokens"]  # type: ignore[index]
    assert usage.prompt_tokens == ref["usage"]["prompt_tokens"]  # type: ignore[index]


def test_completions_endpoint(fleet: Fleet) -> None:
    resp = client(fleet).completions.create(model="sim-8b", prompt="Once upon a time", max_tokens=8)
    assert resp.choices[0].text
    assert resp.usage is not None
    assert resp.usage.completion_tokens <= 8


def test_embeddings(fleet: Fleet) -> None:
    resp = client(fleet).embeddings.create(model="sim-embed", input=["alpha", "beta", "alpha"])
    vecs = [d.embedding for d in resp.data]
    assert len(vecs) == 3
    assert len(vecs[0]) > 0
    assert vecs[0] == vecs[2]  # deterministic per input
    assert vecs[0] != vecs[1]
    assert resp.usage.prompt_tokens > 0


def test_models_listed(fleet: Fleet) -> None:
    ids = {m.id for m in client(fleet).models.list()}
    assert {"sim-8b", "sim-embed"} <= ids


def test_bad_key_is_authentication_error(fleet: Fleet) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(fleet, key="sk-wrong").chat.completions.create(model="sim-8b", messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"


def test_bad_body_is_bad_request(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(fleet).chat.completions.create(
            model="sim-8b",
            messages=[{"role": "wizard", "content": "hi"}],  # type: ignore[list-item, misc]  # a bad role, on purpose
        )
    assert info.value.status_code == 400
    assert "role" in str(info.value)


def test_out_of_range_parameter_is_bad_request(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError):
        client(fleet).chat.completions.create(model="sim-8b", messages=MESSAGES, temperature=7)


def test_unknown_model_is_not_found(fleet: Fleet) -> None:
    with pytest.raises(openai.NotFoundError):
        client(fleet).chat.completions.create(model="gpt-nope", messages=MESSAGES)


def test_invalid_json_is_openai_error(fleet: Fleet) -> None:
    r = httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {fleet.api_key}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_health_ready_metrics(fleet: Fleet) -> None:
    assert httpx.get(f"{fleet.base_url}/healthz").status_code == 200
    ready = httpx.get(f"{fleet.base_url}/readyz").json()
    assert ready == {"ready": True, "checks": {"nats": True, "redis": True}}
    client(fleet).chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=4)
    text = httpx.get(fleet.gateway_metrics_urls[0]).text
    assert 'jetserve_gateway_requests_total{cls="interactive",op="chat",outcome="ok"}' in text
    assert "jetserve_gateway_time_to_first_token_seconds_bucket" in text
    assert 'jetserve_queue_depth{cls="interactive"}' in text
    assert "Tell me about" not in text  # no prompt text in metrics


def test_embeddings_float_and_base64_agree(fleet: Fleet) -> None:
    c = client(fleet)
    as_float = c.embeddings.create(model="sim-embed", input="x", encoding_format="float")
    as_default = c.embeddings.create(model="sim-embed", input="x")  # the SDK asks for base64
    assert as_default.data[0].embedding == pytest.approx(as_float.data[0].embedding, rel=1e-6)


def test_max_tokens_past_the_context_is_refused_at_the_gateway(fleet: Fleet) -> None:
    """As vLLM refuses it, but before any hold or publish: the engine never sees it."""
    body = {"model": "sim-8b", "messages": MESSAGES, "max_tokens": 9000}  # context: 8192
    before = httpx.get(f"{fleet.sim_url}/sim/stats", timeout=10).json()["requests"]
    r = httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {fleet.api_key}"},
        timeout=10,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "max_tokens"
    assert "maximum context length is 8192 tokens" in err["message"]
    assert httpx.get(f"{fleet.sim_url}/sim/stats", timeout=10).json()["requests"] == before
    # The engine itself agrees: the same body straight to it is a 400 too.
    direct = httpx.post(f"{fleet.sim_url}/v1/chat/completions", json=body, timeout=10)
    assert direct.status_code == 400
    # And one that fits still runs.
    ok = client(fleet).chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=8)
    assert ok.choices[0].message.content

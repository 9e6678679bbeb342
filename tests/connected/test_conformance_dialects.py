"""A worker started with `--engine-dialect tgi` serves chat end to end through the gateway,
talking to the simulator's TGI surface."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected


def test_tgi_worker_serves_chat_through_gateway(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(workers=1, worker_args=["--engine-dialect", "tgi"])
    headers = {
        "Authorization": f"Bearer {fleet.api_key}",
        # Forwarded to the engine (x-sim-*): a deterministic reply to check the stop cut.
        "X-Sim-Script": json.dumps({"content": "one two three four five"}),
    }
    body = {
        "model": "sim-8b",
        "messages": [{"role": "user", "content": "Count to five."}],
        "stop": ["four"],
        "max_tokens": 20,
    }
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=body, headers=headers, timeout=20)
    assert r.status_code == 200, r.text
    reply = r.json()
    # The TGI surface keeps the stop string; the TGI adapter cut it, as OpenAI clients expect.
    assert reply["choices"][0]["message"]["content"] == "one two three "
    assert reply["choices"][0]["finish_reason"] == "stop"
    record = httpx.get(
        f"{fleet.sim_url}/sim/requests/{reply['id'].removeprefix('chatcmpl-')}", timeout=5
    ).json()
    assert record["endpoint"] == "tgi_generate_stream"  # it went through TGI's dialect
    assert reply["usage"]["prompt_tokens"] == record["prompt_tokens"]
    assert reply["usage"]["completion_tokens"] == record["generated_tokens"] == 4

    # Streaming, with usage, through the same worker.
    parts: list[str] = []
    usage = None
    with httpx.stream(
        "POST",
        f"{fleet.base_url}/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        headers=headers,
        timeout=20,
    ) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                parts.append(choice["delta"].get("content") or "")
    assert "".join(parts) == "one two three "
    assert usage is not None
    assert usage["completion_tokens"] == 4

    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    # An explicit null max_completion_tokens is its absence: max_tokens still
    # bounds the answer (it hid it: TGI ran on past the hold, to the context).
    long = {
        "model": "sim-8b",
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 5,
        "max_completion_tokens": None,
    }
    script = {"X-Sim-Script": json.dumps({"content": "word " * 100})}
    r = httpx.post(
        f"{fleet.base_url}/v1/chat/completions", json=long, headers={**auth, **script}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"

    # A history whose tool call's arguments are not JSON is the caller's error (a
    # 400 in its words), not the worker's (it was a 500 internal_error).
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    history = {
        "model": "sim-8b",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=history, headers=auth, timeout=60)
    assert r.status_code == 400, r.text
    assert "arguments are not JSON" in r.json()["error"]["message"]

"""The simulator's TGI and Triton surfaces: same engine, same faults, their own wire shapes."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest

from tests.sim.simkit import SimHandle, StartSim, chat_body

TRITON = "/v2/models/sim-8b"
# Long enough to fill KV blocks (16 tokens each), so a repeat hits the prefix cache.
PROMPT = "<|im_start|>user\n" + "tell me about queues " * 12 + "<|im_end|>\n<|im_start|>assistant\n"


async def _events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, list[Any]]:
    """POST and collect SSE data payloads; a payload that is not JSON is kept as a str."""
    out: list[Any] = []
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [r.json()]
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                try:
                    out.append(json.loads(data))
                except ValueError:
                    out.append(data)
    return 200, out


def _tgi(**params: Any) -> dict[str, Any]:
    return {"inputs": PROMPT, "parameters": {"details": True, **params}}


def _triton(**params: Any) -> dict[str, Any]:
    return {
        "text_input": PROMPT,
        "parameters": {"stream": True, **params},
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }


async def test_tgi_stream_shape_usage_and_prefix_cache(fast: SimHandle) -> None:
    rid = uuid.uuid4().hex
    status, events = await _events(
        fast.client, "/generate_stream", _tgi(max_new_tokens=5), {"X-Request-Id": rid}
    )
    assert status == 200
    assert len(events) == 5
    for i, ev in enumerate(events[:-1]):
        assert ev["index"] == i + 1
        assert ev["generated_text"] is None
        assert ev["details"] is None
        assert set(ev["token"]) == {"id", "text", "logprob", "special"}
    last = events[-1]
    text = "".join(e["token"]["text"] for e in events)
    assert last["generated_text"] == text
    assert last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 5
    rec = await fast.record(rid)
    assert rec["endpoint"] == "tgi_generate_stream"
    assert rec["status"] == "finished"
    assert last["details"]["input_length"] == rec["prompt_tokens"]
    # The same prompt again through the OpenAI surface would hit the same prefix cache.
    rid2 = uuid.uuid4().hex
    r = await fast.client.post(
        "/generate", json=_tgi(max_new_tokens=3), headers={"X-Request-Id": rid2}
    )
    assert r.status_code == 200
    body = r.json()
    assert body["details"]["generated_tokens"] == 3
    assert body["generated_text"]
    assert (await fast.record(rid2))["cached_tokens"] > 0


async def test_tgi_keeps_stop_string_and_honours_json_grammar(fast: SimHandle) -> None:
    script = json.dumps({"content": "one two three four five"})
    _, events = await _events(
        fast.client, "/generate_stream", _tgi(stop=["four"]), {"X-Sim-Script": script}
    )
    assert events[-1]["generated_text"] == "one two three four"  # TGI keeps the stop
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    r = await fast.client.post("/generate", json=_tgi(grammar={"type": "json", "value": schema}))
    assert json.loads(r.json()["generated_text"]) == {"city": "sim"}
    r = await fast.client.post("/generate", json=_tgi(grammar={"type": "yaml", "value": 1}))
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation"


@pytest.mark.parametrize(
    ("fault", "status", "error_type"),
    [("429", 429, "overloaded"), ("503", 503, "unavailable"), ("500", 500, "generation")],
)
async def test_tgi_status_faults(fast: SimHandle, fault: str, status: int, error_type: str) -> None:
    rid = uuid.uuid4().hex
    r = await fast.client.post(
        "/generate_stream", json=_tgi(), headers={"X-Sim-Fault": fault, "X-Request-Id": rid}
    )
    assert r.status_code == status
    assert r.json()["error_type"] == error_type
    assert r.json()["error"]
    assert (await fast.record(rid))["status"] == "failed"


async def test_tgi_validation_errors_are_422(start_sim: StartSim) -> None:
    sim = await start_sim(profile="fast", max_model_len=64)
    r = await sim.client.post("/generate_stream", json=_tgi(max_new_tokens=100))
    assert r.status_code == 422
    assert "maximum context length is 64" in r.json()["error"]
    r = await sim.client.post("/generate_stream", json={"parameters": {}})
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation"


async def test_triton_stream_shape_and_usage(fast: SimHandle) -> None:
    rid = uuid.uuid4().hex
    status, events = await _events(
        fast.client, f"{TRITON}/generate_stream", _triton(max_tokens=4), {"X-Request-Id": rid}
    )
    assert status == 200
    assert len(events) == 4
    assert all(e["model_name"] == "sim-8b" and e["model_version"] == "1" for e in events)
    assert [e.get("finish_reason") for e in events] == [None, None, None, "length"]
    rec = await fast.record(rid)
    assert rec["endpoint"] == "triton_generate_stream"
    assert sum(e["num_output_tokens"] for e in events) == rec["generated_tokens"] == 4
    assert events[0]["num_input_tokens"] == rec["prompt_tokens"]
    r = await fast.client.post(
        f"{TRITON}/generate", json={**_triton(max_tokens=4), "exclude_input_in_output": False}
    )
    assert r.json()["text_output"].startswith(PROMPT)


async def test_triton_cuts_stop_like_vllm(fast: SimHandle) -> None:
    script = json.dumps({"content": "one two three four five"})
    _, events = await _events(
        fast.client,
        f"{TRITON}/generate_stream",
        _triton(stop=["four"]),
        {"X-Sim-Script": script},
    )
    assert "".join(e["text_output"] for e in events) == "one two three "
    assert events[-1]["finish_reason"] == "stop"


async def test_triton_errors(fast: SimHandle) -> None:
    r = await fast.client.post("/v2/models/nope/generate_stream", json=_triton())
    assert r.status_code == 400
    assert "unknown model" in r.json()["error"]
    r = await fast.client.post(
        f"{TRITON}/generate_stream", json=_triton(), headers={"X-Sim-Fault": "429"}
    )
    assert r.status_code == 503
    assert r.json() == {"error": "Exceeds maximum queue size"}
    r = await fast.client.post(
        f"{TRITON}/generate_stream", json=_triton(max_tokens=10**7), headers={}
    )
    assert r.status_code == 400
    assert "maximum context length" in r.json()["error"]


async def test_health_routes_and_tgi_gauges(fast: SimHandle) -> None:
    for path in ("/health", "/v2/health/ready", "/v2/health/live", f"{TRITON}/ready"):
        assert (await fast.client.get(path)).status_code == 200
    assert (await fast.client.get("/v2/models/nope/ready")).status_code == 400
    assert (await fast.client.get("/info")).json()["model_id"] == "sim-8b"
    assert await fast.metric("tgi_queue_size") == 0
    assert await fast.metric("tgi_batch_current_size") == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body(stream=True)),
        ("/generate_stream", _tgi()),
        (f"{TRITON}/generate_stream", _triton()),
    ],
)
async def test_malformed_chunk_fault(fast: SimHandle, path: str, body: dict[str, Any]) -> None:
    _, events = await _events(fast.client, path, body, {"X-Sim-Fault": "malformed:1"})
    bad = [i for i, e in enumerate(events) if isinstance(e, str) and e != "[DONE]"]
    assert bad == [1], events[:4]  # event 1 (0-based) is not JSON


@pytest.mark.parametrize(
    ("path", "body"), [("/generate_stream", _tgi()), (f"{TRITON}/generate_stream", _triton())]
)
async def test_client_disconnect_aborts_in_engine(
    fast: SimHandle, path: str, body: dict[str, Any]
) -> None:
    rid = uuid.uuid4().hex
    headers = {"X-Request-Id": rid, "X-Sim-Fault": "slow:50"}
    async with fast.client.stream("POST", path, json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                break  # first token seen; leave
    for _ in range(200):
        if (await fast.record(rid))["status"] == "aborted":
            break
        await asyncio.sleep(0.01)
    rec = await fast.record(rid)
    assert rec["status"] == "aborted"
    assert rec["generated_tokens"] < 16
    assert (await fast.stats())["running"] == 0

"""The OpenAI/vLLM wire surface: stream shape, exact usage, limits, errors, small routes."""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Any

from tests.sim.simkit import SimHandle, StartSim, chat_body, sse


def _content(events: list[dict[str, Any]]) -> list[str]:
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if e["choices"]
        and "content" in e["choices"][0]["delta"]
        and "role" not in e["choices"][0]["delta"]
    ]


async def test_chat_stream_shape(fast: SimHandle) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    s = await sse(fast.client, "/v1/chat/completions", body)
    assert s.status == 200
    assert s.done
    assert s.headers["content-type"].startswith("text/event-stream")
    first, *middle, last_content, usage_chunk = s.events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["object"] == "chat.completion.chunk"
    assert first["id"].startswith("chatcmpl-")
    assert all(e["id"] == first["id"] for e in s.events)
    assert all(e["choices"][0]["finish_reason"] is None for e in [first, *middle])
    assert last_content["choices"][0]["finish_reason"] == "stop"
    assert last_content["choices"][0]["delta"]["content"]
    assert "usage" not in last_content
    assert usage_chunk["choices"] == []
    u = usage_chunk["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_stream_without_usage_has_no_usage_chunk(fast: SimHandle) -> None:
    s = await sse(fast.client, "/v1/chat/completions", chat_body(stream=True))
    assert s.done
    assert all(e["choices"] for e in s.events)
    assert all("usage" not in e for e in s.events)


async def test_usage_is_exact_and_stream_equals_non_stream(fast: SimHandle) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Summarise the design, please: queues, KV, retries!"},
    ]
    body = {"model": "sim-8b", "messages": messages, "seed": 7}
    tok = (
        await fast.client.post("/tokenize", json={"model": "sim-8b", "messages": messages})
    ).json()
    full = (await fast.client.post("/v1/chat/completions", json=body)).json()
    s = await sse(
        fast.client, "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    pieces = _content(s.events)
    usage = s.events[-1]["usage"]
    assert full["usage"]["prompt_tokens"] == tok["count"] == usage["prompt_tokens"]
    assert usage["completion_tokens"] == len(pieces) == full["usage"]["completion_tokens"]
    assert "".join(pieces) == full["choices"][0]["message"]["content"]
    assert 16 <= len(pieces) <= 64  # the natural length range
    assert full["object"] == "chat.completion"
    assert full["id"].startswith("chatcmpl-")
    assert full["choices"][0]["finish_reason"] == "stop"
    # Deterministic: the same request gives the same text again.
    again = (await fast.client.post("/v1/chat/completions", json=body)).json()
    assert again["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"]


async def test_text_completions_stream_and_non_stream(fast: SimHandle) -> None:
    body = {"model": "sim-8b", "prompt": "Once upon a time", "max_tokens": 12}
    tok = (await fast.client.post("/tokenize", json={"prompt": "Once upon a time"})).json()
    full = (await fast.client.post("/v1/completions", json=body)).json()
    s = await sse(
        fast.client, "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    texts = [e["choices"][0]["text"] for e in s.events if e["choices"]]
    assert full["object"] == "text_completion"
    assert full["id"].startswith("cmpl-")
    assert s.events[0]["object"] == "text_completion"
    assert "".join(texts) == full["choices"][0]["text"]
    assert full["usage"]["prompt_tokens"] == tok["count"] == 4
    assert full["usage"]["completion_tokens"] == len(texts) == 12
    assert s.events[-2]["choices"][0]["finish_reason"] == "length"
    assert s.events[-1]["choices"] == []
    assert s.done
    # Token-id prompts are accepted too.
    by_ids = await fast.client.post("/v1/completions", json={"prompt": tok["tokens"]})
    assert by_ids.status_code == 200
    assert by_ids.json()["usage"]["prompt_tokens"] == 4


async def test_max_tokens_gives_length(fast: SimHandle) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        r = (
            await fast.client.post("/v1/chat/completions", json=chat_body("Hi", **{field: 5}))
        ).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == 5
    s = await sse(fast.client, "/v1/chat/completions", chat_body(stream=True, max_tokens=3))
    assert len(_content(s.events)) == 3
    assert s.events[-1]["choices"][0]["finish_reason"] == "length"


async def test_ignore_eos_forces_max_tokens(fast: SimHandle) -> None:
    r = await fast.client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=150, ignore_eos=True)
    )
    assert r.json()["usage"]["completion_tokens"] == 150
    assert r.json()["choices"][0]["finish_reason"] == "length"  # as vLLM ends it


async def test_stop_sequences(fast: SimHandle) -> None:
    base = chat_body("Tell me about stop strings", seed=3)
    text = (await fast.client.post("/v1/chat/completions", json=base)).json()
    content = text["choices"][0]["message"]["content"]
    words = content.split()
    stop = " " + " ".join(words[5:7]).strip(".")  # two words mid-text
    cut = content[: content.index(stop)]
    r = (await fast.client.post("/v1/chat/completions", json={**base, "stop": [stop]})).json()
    assert r["choices"][0]["message"]["content"] == cut
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["stop_reason"] == stop
    s = await sse(fast.client, "/v1/chat/completions", {**base, "stop": stop, "stream": True})
    assert "".join(_content(s.events)) == cut
    assert s.events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(stop not in c for c in _content(s.events))


async def test_unknown_model_is_404(fast: SimHandle) -> None:
    r = await fast.client.post("/v1/chat/completions", json={**chat_body(), "model": "nope"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 404
    assert "nope" in err["message"]


async def test_bad_requests_are_400(start_sim: StartSim) -> None:
    h = await start_sim(profile="fast", max_model_len=64)
    long_prompt = " ".join(f"w{i}" for i in range(80))
    cases = [
        chat_body(long_prompt),  # prompt over max_model_len
        chat_body(max_tokens=60),  # prompt + max_tokens over max_model_len
        chat_body(n=17),  # more choices than the simulator draws
        chat_body(max_tokens=0),
        {"model": "sim-8b", "messages": "hi"},
        {"model": "sim-8b"},
    ]
    for body in cases:
        r = await h.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["code"] == 400
    r = await h.client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"
    r = await h.client.post("/v1/chat/completions", json=chat_body(long_prompt))
    assert "maximum context length is 64" in r.json()["error"]["message"]


async def test_models_tokenize_health_version(fast: SimHandle) -> None:
    models = (await fast.client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "sim-8b"
    assert models["data"][0]["max_model_len"] == 8192
    h = await fast.client.get("/health")
    assert h.status_code == 200
    assert h.content == b""
    tok = (
        await fast.client.post("/tokenize", json={"prompt": "a b, c", "return_token_strs": True})
    ).json()
    assert tok == {"count": 4, "max_model_len": 8192, "tokens": tok["tokens"],
                   "token_strs": ["a", " b", ",", " c"]}  # fmt: skip
    assert (await fast.client.get("/version")).status_code == 200


async def test_request_id_and_record(fast: SimHandle) -> None:
    rid = f"req-{uuid.uuid4().hex}"
    before = time.time()
    r = await fast.client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=4), headers={"X-Request-Id": rid}
    )
    after = time.time()
    assert r.json()["id"] == f"chatcmpl-{rid}"
    assert r.headers["x-request-id"] == rid
    rec = await fast.record(rid)
    assert rec["status"] == "finished"
    assert rec["generated_tokens"] == 4
    assert rec["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert before <= rec["arrived_at"] <= rec["first_token_at"] <= rec["finished_at"] <= after
    assert rec["aborted_at"] is None
    missing = await fast.client.get("/sim/requests/never-seen")
    assert missing.status_code == 404


async def test_embeddings_deterministic_unit_vectors(fast: SimHandle) -> None:
    body = {"model": "sim-8b", "input": ["hello world", "something else"]}
    a = (await fast.client.post("/v1/embeddings", json=body)).json()
    b = (await fast.client.post("/v1/embeddings", json=body)).json()
    assert a["object"] == "list"
    assert len(a["data"]) == 2
    v0, v1 = (d["embedding"] for d in a["data"])
    assert len(v0) == 384
    assert math.isclose(math.fsum(x * x for x in v0), 1.0, rel_tol=1e-6)  # float32 values
    assert v0 == b["data"][0]["embedding"]
    assert v0 != v1
    assert a["usage"]["prompt_tokens"] == 4 == a["usage"]["total_tokens"]
    one = (await fast.client.post("/v1/embeddings", json={"input": "hello world"})).json()
    assert one["data"][0]["embedding"] == v0
    ids = (await fast.client.post("/tokenize", json={"prompt": "hello world"})).json()["tokens"]
    for inp in (ids, [ids]):
        by_ids = (await fast.client.post("/v1/embeddings", json={"input": inp})).json()
        assert by_ids["data"][0]["embedding"] == v0
    b64 = (
        await fast.client.post(
            "/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"}
        )
    ).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    floats = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(floats) == 384
    assert math.isclose(floats[0], v0[0], rel_tol=1e-6)
    small = (
        await fast.client.post("/v1/embeddings", json={"input": "hello world", "dimensions": 64})
    ).json()["data"][0]["embedding"]
    assert len(small) == 64
    assert math.isclose(math.fsum(x * x for x in small), 1.0)
    bad = await fast.client.post("/v1/embeddings", json={"input": []})
    assert bad.status_code == 400


async def test_metrics_use_vllm_names(fast: SimHandle) -> None:
    await fast.client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    text = (await fast.client.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        assert f'{name}{{engine="0",' in text, name
    assert (
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-8b"} 1.0'
        in text
    )
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info
    assert 'num_gpu_blocks="8192"' in info
    assert info.endswith(" 1.0")
    assert await fast.metric("vllm:generation_tokens_total") == 3
    assert await fast.metric("vllm:time_to_first_token_seconds_count") == 1
    assert await fast.metric("vllm:inter_token_latency_seconds_count") == 2


async def test_lora_adapters_listed_with_parent_and_answer_differently(
    start_sim: StartSim,
) -> None:
    """``--lora NAME``: served as vLLM serves --lora-modules, its own text."""
    h = await start_sim(profile="fast", loras=("sql-lora",))
    cards = {m["id"]: m for m in (await h.client.get("/v1/models")).json()["data"]}
    assert cards["sim-8b"]["parent"] is None
    assert cards["sql-lora"]["parent"] == "sim-8b"
    assert cards["sql-lora"]["root"] == "sql-lora"

    async def text(model: str) -> str:
        r = await h.client.post("/v1/chat/completions", json=chat_body(model=model, seed=3))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return str(r.json()["choices"][0]["message"]["content"])

    base, adapted = await text("sim-8b"), await text("sql-lora")
    assert adapted != base
    assert await text("sql-lora") == adapted  # deterministic
    assert await text("sim-8b") == base
    r = await h.client.post("/v1/chat/completions", json=chat_body(model="other-lora"))
    assert r.status_code == 404

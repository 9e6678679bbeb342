"""The llama.cpp adapter against a real llama.cpp server (llama-cpp-python[server],
built from source for the CPU, a tiny random-weight GGUF made locally): the
conformance corpus, one request through a whole fleet, and a cancellation through a
fleet. Opt-in (docs/adapters.md): `bench/peers/llamacpp.sh` or `make test-engines`.

The model's words are random, so the checks are about the wire; greedy decoding
(temperature 0) makes two runs of a prompt comparable.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from jetserve.conformance.report import Status
from jetserve.conformance.runner import run_corpus
from jetserve.fleet import Fleet, FleetSpec
from tests.engine_corpus import real_engine_cases
from tests.engine_fleet import stream_through_fleet
from tests.engine_reports import save
from tests.llamacpp.llamacppkit import CONTEXT, LlamaCppServer
from tests.waits import until_sync
from workers.engines.base import Done
from workers.engines.llamacpp import LlamaCppAdapter
from workers.errors import EngineRejected

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(240)]

# Rows the adapter loses against the real server, each with the runner's note,
# exactly: anything else dropped fails the test. See docs/adapters.md.
KNOWN_DROPS: dict[str, str] = {}


def chat(server: LlamaCppServer, text: str, **kw: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": text}], **kw}


@pytest.fixture
async def adapter(llamacpp_server: LlamaCppServer) -> AsyncIterator[LlamaCppAdapter]:
    async with LlamaCppAdapter(llamacpp_server.url, context_length=CONTEXT) as a:
        yield a


def eos_id(server: LlamaCppServer) -> int:
    """The end-of-generation token's id: /extras/tokenize reads special tokens and
    adds BOS first."""
    r = httpx.post(f"{server.url}/extras/tokenize", json={"input": "<|eot_id|>"}, timeout=5)
    return int(r.json()["tokens"][-1])


async def test_corpus_against_real_llamacpp(
    adapter: LlamaCppAdapter, llamacpp_server: LlamaCppServer
) -> None:
    report = await run_corpus(
        adapter,
        engine_url=llamacpp_server.url,
        dialect="llamacpp",
        faults_supported=False,
        cases=real_engine_cases(),
        timeout_s=60.0,
    )
    async with httpx.AsyncClient(timeout=5) as c:
        info = (await c.get(f"{llamacpp_server.url}/openapi.json")).json()["info"]
    saved = save("llamacpp", report, f"llama-cpp-python {info['version']}, CPU build")
    print(f"\nllamacpp tier: translation-loss report ({saved})\n" + report.to_markdown())
    assert not report.failures, report.to_markdown()
    for row in report.silent_drops:
        assert KNOWN_DROPS.get(row.field) == row.note, report.to_markdown()
    judged = {r.field for r in report.rows if r.status is not Status.NOT_APPLICABLE}
    assert {"messages", "stop", "stream_options.include_usage", "n"} <= judged


async def test_streamed_usage_equals_the_servers_own_count(
    adapter: LlamaCppAdapter, llamacpp_server: LlamaCppServer
) -> None:
    """The server's stream has no usage; the adapter's count of completion tokens
    (one chunk per token) equals its unstreamed answer's, and so do the prompt tokens
    of a completion (both tokenize the prompt the same way)."""
    body = {"model": "tiny", "prompt": "Count the tokens", "max_tokens": 20, "temperature": 0}
    async with httpx.AsyncClient(timeout=30) as c:
        whole = (await c.post(f"{llamacpp_server.url}/v1/completions", json=body)).json()
    done = None
    async for ev in adapter.generate("completion", body, "t-usage", {}):
        if isinstance(ev, Done):
            done = ev
    assert done is not None
    assert done.usage.completion_tokens == whole["usage"]["completion_tokens"]
    assert done.usage.prompt_tokens == whole["usage"]["prompt_tokens"]


@pytest.mark.connected
def test_one_request_through_a_fleet(llamacpp_server: LlamaCppServer) -> None:
    """SDK -> gateway -> NATS -> worker (--engine-dialect llamacpp) -> llama.cpp and
    back: the streamed reply equals the server's own greedy answer."""
    body = chat(llamacpp_server, "Through the fleet, please.", max_tokens=24, temperature=0)
    direct = httpx.post(f"{llamacpp_server.url}/v1/chat/completions", json=body, timeout=30).json()
    got = stream_through_fleet(fleet_spec(llamacpp_server), body)
    assert got.text == direct["choices"][0]["message"]["content"]
    assert got.finish == direct["choices"][0]["finish_reason"]
    assert got.usage is not None
    assert got.usage.completion_tokens == direct["usage"]["completion_tokens"]
    assert got.usage.prompt_tokens > 0


def fleet_spec(server: LlamaCppServer) -> FleetSpec:
    return FleetSpec(
        workers=1,
        engine_url=server.url,
        model=server.model,
        worker_args=["--engine-dialect", "llamacpp", "--engine-context-length", str(CONTEXT)],
    )


@pytest.mark.connected
async def test_cancel_through_a_fleet_stops_the_engine(
    llamacpp_server: LlamaCppServer,
) -> None:
    """A client that hangs up after 5 tokens of a 900-token stream (end-of-generation
    banned by logit_bias): the server logs the disconnect, and since it runs one
    request at a time, a request sent right after is answered long before the 900
    tokens would have been done."""
    url = llamacpp_server.url
    ban = {str(eos_id(llamacpp_server)): -100}
    long = chat(llamacpp_server, "Talk.", max_tokens=900, temperature=0, logit_bias=ban)
    short = chat(llamacpp_server, "Hi.", max_tokens=1)
    async with httpx.AsyncClient(timeout=60) as c:
        t0 = time.monotonic()
        r = await c.post(f"{url}/v1/chat/completions", json=long)
        full_s = time.monotonic() - t0
        assert r.json()["usage"]["completion_tokens"] == 900
        with Fleet(fleet_spec(llamacpp_server)) as fleet:
            auth = {"Authorization": f"Bearer {fleet.api_key}"}
            before = llamacpp_server.disconnects()
            tokens = 0
            async with c.stream(
                "POST", f"{fleet.base_url}/v1/chat/completions",
                json={**long, "stream": True}, headers=auth,
            ) as s:  # fmt: skip
                async for line in s.aiter_lines():
                    tokens += line.startswith("data: ") and '"content"' in line
                    if tokens == 5:
                        break
            t1 = time.monotonic()
            r = await c.post(f"{url}/v1/chat/completions", json=short)
            next_s = time.monotonic() - t1
            assert r.status_code == 200
            await until_sync(
                lambda: llamacpp_server.disconnects() > before, "the server to log the hang-up"
            )
    print(
        f"\nllamacpp tier: 900 tokens take {full_s:.2f}s; after a hang-up at 5 tokens the "
        f"next request was answered in {next_s:.2f}s"
    )
    assert llamacpp_server.disconnects() > before
    assert next_s < full_s / 3


async def test_prompt_over_the_context_is_the_servers_own_400(
    llamacpp_server: LlamaCppServer,
) -> None:
    """Without context_length the adapter cannot tell; the server's stream breaks
    without a word, and the adapter's unstreamed retry brings back the server's 400."""
    body = chat(llamacpp_server, "x " * 2000, max_tokens=8)
    async with LlamaCppAdapter(llamacpp_server.url) as a:
        with pytest.raises(EngineRejected) as err:
            async for _ in a.generate("chat", body, "t-long", {}):
                pass
    assert err.value.status == 400
    assert "context" in err.value.message, err.value.message

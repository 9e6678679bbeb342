"""The simulator's TGI and Triton dialects take their engines' native parameters, check
them with the engines' own words, and apply them deterministically."""

from __future__ import annotations

import json
from typing import Any

from tests.sim.simkit import SimHandle
from tests.sim.test_sim_dialects import PROMPT, TRITON, _events, _tgi

COUNT = json.dumps({"content": "one two three four five"})


def _triton(**sampling: Any) -> dict[str, Any]:
    return {
        "text_input": PROMPT,
        "stream": True,
        "sampling_parameters": json.dumps(sampling),
        "return_finish_reason": True,
        "return_num_output_tokens": True,
    }


async def test_tgi_top_n_tokens_and_logprobs(fast: SimHandle) -> None:
    _, events = await _events(
        fast.client, "/generate_stream", _tgi(max_new_tokens=4, top_n_tokens=3), {}
    )
    assert len(events) == 4
    for ev in events:
        assert ev["token"]["logprob"] <= 0
        assert [t["logprob"] for t in ev["top_tokens"]] == sorted(
            (t["logprob"] for t in ev["top_tokens"]), reverse=True
        )
        assert len(ev["top_tokens"]) == 3
    r = await fast.client.post("/generate", json=_tgi(max_new_tokens=3, top_n_tokens=9))
    assert r.status_code == 422
    assert "`top_n_tokens` must be >= 0 and <= 5" in r.json()["error"]


async def test_tgi_best_of_on_generate_only(fast: SimHandle) -> None:
    body = _tgi(max_new_tokens=6, best_of=3, do_sample=True, decoder_input_details=True)
    r = await fast.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2
    best = sum(t["logprob"] for t in details["tokens"])
    assert all(best >= sum(t["logprob"] for t in o["tokens"]) for o in others)
    assert len(details["prefill"]) > 0
    assert details["prefill"][0]["logprob"] is None
    cases = [
        ("/generate_stream", body, "`best_of` != 1 is not supported when streaming tokens"),
        ("/generate", _tgi(best_of=2), "you must use sampling when `best_of` is > 1"),
        ("/generate", {**body, "parameters": {**body["parameters"], "seed": 1}}, "`seed`"),
    ]
    for path, payload, message in cases:
        r = await fast.client.post(path, json=payload)
        assert r.status_code == 422
        assert message in r.json()["error"]


async def test_tgi_sampling_checks_and_greedy_default(fast: SimHandle) -> None:
    for params, message in (
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
    ):
        r = await fast.client.post("/generate", json=_tgi(max_new_tokens=4, **params))
        assert r.status_code == 422
        assert message in r.json()["error"]

    async def text(**params: Any) -> str:
        r = await fast.client.post("/generate", json=_tgi(**{"max_new_tokens": 12, **params}))
        return str(r.json()["generated_text"])

    # Without sampling TGI is greedy: the seed changes nothing; with it, it does.
    assert await text(seed=1) == await text(seed=2)
    assert await text(seed=1, do_sample=True) != await text(seed=2, do_sample=True)
    reply = await text(max_new_tokens=40, repetition_penalty=1.5)
    words = reply.lower().replace(".", " ").split()
    assert len(set(words)) == len(words)


async def test_tgi_regex_grammar_of_choices(fast: SimHandle) -> None:
    grammar = {"type": "regex", "value": "(?:sunny|cloudy\\.)"}
    r = await fast.client.post("/generate", json=_tgi(grammar=grammar))
    assert r.json()["generated_text"] in ("sunny", "cloudy.")
    r = await fast.client.post("/generate", json=_tgi(grammar={"type": "regex", "value": "a+"}))
    assert r.status_code == 422


async def test_triton_n_logprobs_and_structured_outputs(fast: SimHandle) -> None:
    body = {**_triton(n=2, max_tokens=5, logprobs=2, seed=3), "return_logprobs": True}
    _, events = await _events(fast.client, f"{TRITON}/generate_stream", body, {})
    assert all(len(e["text_output"]) == 2 for e in events)
    assert events[0]["finish_reason"] == ["None", "None"]
    assert events[-1]["finish_reason"] == ["length", "length"]
    texts = ["".join(e["text_output"][j] for e in events) for j in range(2)]
    assert texts[0] != texts[1]
    for j in range(2):
        steps = [s for e in events for s in json.loads(e["logprobs"][j])]
        assert len(steps) == 5
        assert "".join(next(iter(s.values()))["decoded_token"] for s in steps) == texts[j]
        assert all(sorted(x["rank"] for x in s.values()) == [1, 2] for s in steps)
    choice = json.dumps({"choice": ["sunny", "cloudy"]})
    r = await fast.client.post(
        f"{TRITON}/generate", json={**_triton(structured_outputs=choice), "stream": False}
    )
    assert r.json()["text_output"] in ("sunny", "cloudy")


async def test_triton_refuses_what_vllm_refuses(fast: SimHandle) -> None:
    for sampling, message in (
        ({"best_of": 2}, "best_of"),  # gone from vLLM V1's SamplingParams
        ({"logit_bias": {"5": 10}}, "not supported between instances of 'str' and 'int'"),
        ({"presence_penalty": 5.0}, "presence_penalty must be in [-2, 2]"),
        ({"logprobs": 50}, "greater than max allowed: 20"),
    ):
        r = await fast.client.post(f"{TRITON}/generate_stream", json=_triton(**sampling))
        assert r.status_code == 400
        assert message in r.json()["error"]
    echo = {**_triton(), "exclude_input_in_output": False}
    r = await fast.client.post(f"{TRITON}/generate_stream", json=echo)
    assert r.status_code == 400
    assert "exclude_input_in_output" in r.json()["error"]


async def test_triton_min_tokens_and_ignore_eos(fast: SimHandle) -> None:
    async def tokens(**sampling: Any) -> int:
        _, events = await _events(
            fast.client, f"{TRITON}/generate_stream", _triton(**sampling), {"X-Sim-Script": COUNT}
        )
        return sum(e["num_output_tokens"] for e in events)

    assert await tokens(max_tokens=20) == 5
    assert await tokens(max_tokens=20, min_tokens=9) == 9
    assert await tokens(max_tokens=12, ignore_eos=True) == 12

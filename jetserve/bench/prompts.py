"""Prompt text and request bodies for a schedule.

A prompt is plain words, one token each in the simulator's tokenizer (about one
in a real one), laid out as [run salt][shared group prefix][unique words]. The salt is
one word per (target, rate) run: runs never hit the engine's prefix cache with an
earlier run's prompts, while requests of one group still share their prefix within
a run. The first unique word carries the request index, so no two prompts collide.
"""

from __future__ import annotations

import random
from typing import Any, Literal

import msgspec

from jetserve.bench.workload import RequestSpec

Api = Literal["chat", "completions"]

_TEXT = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education river stone garden light"
)
_WORDS = tuple(_TEXT.split())


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(_WORDS) for _ in range(n)]


def prompt_text(req: RequestSpec, *, seed: int, salt: str) -> str:
    parts = [salt]
    plen = min(req.prefix_len, max(req.input_tokens - 2, 0))
    if req.prefix_group is not None and plen > 0:
        parts += _words(random.Random(f"jetserve-bench:{seed}:pfx:{req.prefix_group}"), plen)
    rest = max(req.input_tokens - len(parts), 1)
    parts.append(f"r{req.index}")
    parts += _words(random.Random(f"jetserve-bench:{seed}:req:{req.index}"), rest - 1)
    return " ".join(parts)


def request_body(
    req: RequestSpec,
    *,
    api: Api,
    model: str,
    seed: int,
    salt: str,
    ignore_eos: bool = True,
) -> bytes:
    """A streaming request that asks for the usage chunk (output tokens are counted
    from it) and, with `ignore_eos` (a vLLM extension), exactly output_tokens tokens."""
    text = prompt_text(req, seed=seed, salt=salt)
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": req.output_tokens,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return msgspec.json.encode(body)


def api_path(api: Api) -> str:
    return "/chat/completions" if api == "chat" else "/completions"

"""Build the adapter for an engine dialect: openai (vLLM and compatibles), llamacpp
(llama.cpp's OpenAI-compatible server), tgi, triton."""

from __future__ import annotations

from typing import Literal, get_args

from workers.engines.base import EngineAdapter

Dialect = Literal["openai", "llamacpp", "tgi", "triton"]
DIALECTS: tuple[str, ...] = get_args(Dialect)
# The dialects `jetserve sim` speaks (docs/conformance.md's reports): not llamacpp,
# whose adapter needs the llama.cpp server's own /extras routes.
SIM_DIALECTS: tuple[str, ...] = ("openai", "tgi", "triton")


def make_adapter(
    dialect: str,
    base_url: str,
    api_key: str | None = None,
    model: str = "",
    context_length: int | None = None,
) -> EngineAdapter:
    """`model` names the Triton model in its URL (required there); others ignore it.
    `context_length`: the llama.cpp server's --n_ctx, if known (its server clips a
    max_tokens beyond it silently; knowing it, the adapter refuses as vLLM does)."""
    if dialect == "openai":
        from workers.engines.openai import OpenAIAdapter

        return OpenAIAdapter(base_url, api_key=api_key)
    if dialect == "llamacpp":
        from workers.engines.llamacpp import LlamaCppAdapter

        return LlamaCppAdapter(base_url, api_key=api_key, context_length=context_length)
    if dialect == "tgi":
        from workers.engines.tgi import TGIAdapter

        return TGIAdapter(base_url, api_key=api_key, model=model)
    if dialect == "triton":
        from workers.engines.triton import TritonAdapter

        return TritonAdapter(base_url, api_key=api_key, model=model)
    raise ValueError(f"unknown engine dialect {dialect!r}; known: {', '.join(DIALECTS)}")

"""Build the adapter for an engine dialect: openai (vLLM and compatibles), tgi, triton."""

from __future__ import annotations

from typing import Literal, get_args

from workers.engines.base import EngineAdapter

Dialect = Literal["openai", "tgi", "triton"]
DIALECTS: tuple[str, ...] = get_args(Dialect)


def make_adapter(
    dialect: str, base_url: str, api_key: str | None = None, model: str = ""
) -> EngineAdapter:
    """`model` names the Triton model in its URL (required there); others ignore it."""
    if dialect == "openai":
        from workers.engines.openai import OpenAIAdapter

        return OpenAIAdapter(base_url, api_key=api_key)
    if dialect == "tgi":
        from workers.engines.tgi import TGIAdapter

        return TGIAdapter(base_url, api_key=api_key, model=model)
    if dialect == "triton":
        from workers.engines.triton import TritonAdapter

        return TritonAdapter(base_url, api_key=api_key, model=model)
    raise ValueError(f"unknown engine dialect {dialect!r}; known: {', '.join(DIALECTS)}")

"""vLLM's Prometheus gauges read as an engine's load (the OpenAI adapter's
engine, and Triton's vLLM backend)."""

from __future__ import annotations

import re

from workers.engines.base import EngineLoad

_METRIC_LINE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_vllm_metrics(text: str) -> EngineLoad:
    """Sum vLLM gauges over label sets (one engine may serve several model names)."""
    sums: dict[str, float] = {}
    blocks: int | None = None
    block_size: int | None = None
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name == "vllm:cache_config_info":
            found = dict(_LABEL.findall(labels))
            if found.get("num_gpu_blocks", "").isdigit():
                blocks = int(found["num_gpu_blocks"])
            if found.get("block_size", "").isdigit():
                block_size = int(found["block_size"])
            continue
        try:
            sums[name] = sums.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return EngineLoad(
        kv_usage=sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc")),
        waiting=sums.get("vllm:num_requests_waiting"),
        running=sums.get("vllm:num_requests_running"),
        num_gpu_blocks=blocks,
        block_size=block_size,
    )

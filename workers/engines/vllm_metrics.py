"""vLLM's Prometheus gauges read as an engine's load (the OpenAI adapter's
engine, and Triton's vLLM backend)."""

from __future__ import annotations

import re

from workers.engines.base import EngineLoad

_METRIC_LINE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


# Fractions, one sample per engine core (label ``engine``): averaged, not summed.
# Summed, two data-parallel cores at 48% read 96%, and the worker stopped pulling
# at half the engine's capacity.
_FRACTIONS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def vllm_sums(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """vLLM's samples summed over label sets (one engine may serve several model
    names, or run several engine cores; its usage fractions averaged), and the
    labels of ``cache_config_info``, ``num_gpu_blocks`` summed over the cores."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    caches: dict[str, dict[str, str]] = {}  # per engine core
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name == "vllm:cache_config_info":
            found = dict(_LABEL.findall(labels))
            caches[found.get("engine", "")] = found
            continue
        try:
            sums[name] = sums.get(name, 0.0) + float(value)
        except ValueError:
            continue
        counts[name] = counts.get(name, 0) + 1
    for name in _FRACTIONS:
        if name in sums:
            sums[name] /= counts[name]
    cache: dict[str, str] = {}
    for core in caches.values():
        cache = {**core, **cache}
    blocks = [c["num_gpu_blocks"] for c in caches.values() if c.get("num_gpu_blocks", "").isdigit()]
    if blocks:
        cache["num_gpu_blocks"] = str(sum(int(b) for b in blocks))
    return sums, cache


def parse_vllm_metrics(text: str) -> EngineLoad:
    """vLLM's gauges as an engine's load."""
    sums, cache = vllm_sums(text)
    blocks = block_size = None
    if cache.get("num_gpu_blocks", "").isdigit():
        blocks = int(cache["num_gpu_blocks"])
    if cache.get("block_size", "").isdigit():
        block_size = int(cache["block_size"])
    return EngineLoad(
        kv_usage=sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc")),
        waiting=sums.get("vllm:num_requests_waiting"),
        running=sums.get("vllm:num_requests_running"),
        num_gpu_blocks=blocks,
        block_size=block_size,
    )

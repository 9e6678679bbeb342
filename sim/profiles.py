"""Hardware/model profiles: the latency model and engine limits a simulator starts from."""

from __future__ import annotations

import random

import msgspec


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    prefill_overhead_s: float  # fixed cost of a scheduling step that runs a prefill
    prefill_per_token_s: float  # cost per prompt token that missed the prefix cache
    itl_base_s: float  # inter-token latency with a single running sequence
    itl_load_alpha: float  # ITL grows by this fraction at a full batch (max_num_seqs running)
    itl_jitter: float  # +/- fraction of seeded uniform noise on every ITL
    max_num_seqs: int
    num_gpu_blocks: int
    max_model_len: int
    embed_overhead_s: float
    embed_per_token_s: float

    def itl(self, running: int, max_num_seqs: int, rng: random.Random) -> float:
        """Decode step time for one token, given how many sequences share the batch."""
        if self.itl_base_s <= 0.0:
            return 0.0
        load = max(running - 1, 0) / max(max_num_seqs, 1)
        base = self.itl_base_s * (1.0 + self.itl_load_alpha * load)
        if self.itl_jitter > 0.0:
            base *= 1.0 + self.itl_jitter * (2.0 * rng.random() - 1.0)
        return max(base, 0.0)

    def prefill(self, uncached_tokens: int) -> float:
        """Time from admission to the first token."""
        if self.prefill_overhead_s <= 0.0 and self.prefill_per_token_s <= 0.0:
            return 0.0
        return self.prefill_overhead_s + uncached_tokens * self.prefill_per_token_s

    def embed(self, tokens: int) -> float:
        if self.embed_overhead_s <= 0.0 and self.embed_per_token_s <= 0.0:
            return 0.0
        return self.embed_overhead_s + tokens * self.embed_per_token_s


PROFILES: dict[str, Profile] = {
    # Llama-3.1-8B class model on one H100: ~4k tokens/s prefill, ~80 tok/s/stream decode.
    "h100-8b": Profile(
        name="h100-8b",
        prefill_overhead_s=0.030,
        prefill_per_token_s=0.00025,
        itl_base_s=0.012,
        itl_load_alpha=0.75,
        itl_jitter=0.05,
        max_num_seqs=16,
        num_gpu_blocks=4096,
        max_model_len=8192,
        embed_overhead_s=0.005,
        embed_per_token_s=0.00002,
    ),
    # Zero latency for functional tests; the engine still yields between tokens.
    "fast": Profile(
        name="fast",
        prefill_overhead_s=0.0,
        prefill_per_token_s=0.0,
        itl_base_s=0.0,
        itl_load_alpha=0.0,
        itl_jitter=0.0,
        max_num_seqs=64,
        num_gpu_blocks=8192,
        max_model_len=8192,
        embed_overhead_s=0.0,
        embed_per_token_s=0.0,
    ),
    # Mirrors the CPU vLLM peer with a tiny model (see peers/RECIPES.md): slow and small.
    "cpu-tiny": Profile(
        name="cpu-tiny",
        prefill_overhead_s=0.010,
        prefill_per_token_s=0.001,
        itl_base_s=0.025,
        itl_load_alpha=1.0,
        itl_jitter=0.10,
        max_num_seqs=4,
        num_gpu_blocks=512,
        max_model_len=1024,
        embed_overhead_s=0.005,
        embed_per_token_s=0.0002,
    ),
}

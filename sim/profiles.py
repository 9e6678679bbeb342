"""Hardware/model profiles: the step-time model and engine limits a simulator starts from.

A scheduling step runs one forward pass over every token the scheduler put in it
(decode tokens and prefill chunks together, as vLLM's v1 scheduler does). Its time:

    step = step_overhead
         + max(weight_read, batch_tokens * token_compute)   # memory- vs compute-bound
         + batch_rows * per_seq
         + context_tokens * kv_read_per_token                # attention reads the KV cache

A small batch of decodes costs about one read of the weights (memory-bound); a long
prefill chunk costs its FLOPs (compute-bound); every sequence in the batch adds its
KV-cache read, which grows with its context length. Before its first step a request
spends `frontend_s` in vLLM's API server (validation, tokenization, the hop to the
engine core), outside the scheduler's queue. docs/simulator.md gives the fit.
"""

from __future__ import annotations

import random

import msgspec


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    frontend_s: float  # arrival to the engine's queue: API server, tokenizer, IPC hop
    step_overhead_s: float  # fixed cost of every step (launch, scheduling, sampling setup)
    weight_read_s: float  # streaming the weights once: the floor of any forward pass
    token_compute_s: float  # compute per token in the batch (prefill and decode alike)
    per_seq_s: float  # per sequence (row) in the batch: logits, sampling, bookkeeping
    kv_read_per_token_s: float  # per context token whose KV the step's attention reads
    step_jitter: float  # +/- fraction of seeded uniform noise on every step
    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget (chunked prefill)
    num_gpu_blocks: int
    max_model_len: int
    embed_overhead_s: float
    embed_per_token_s: float

    @property
    def zero_latency(self) -> bool:
        return (
            self.step_overhead_s <= 0.0
            and self.weight_read_s <= 0.0
            and self.token_compute_s <= 0.0
            and self.per_seq_s <= 0.0
            and self.kv_read_per_token_s <= 0.0
        )

    def step_time(
        self, tokens: int, rows: int, context_tokens: int, rng: random.Random | None = None
    ) -> float:
        """Seconds for one step over `tokens` scheduled tokens in `rows` sequences whose
        attention reads `context_tokens` tokens of KV cache in all."""
        if self.zero_latency:
            return 0.0
        t = (
            self.step_overhead_s
            + max(self.weight_read_s, tokens * self.token_compute_s)
            + rows * self.per_seq_s
            + context_tokens * self.kv_read_per_token_s
        )
        if self.step_jitter > 0.0 and rng is not None:
            t *= 1.0 + self.step_jitter * (2.0 * rng.random() - 1.0)
        return max(t, 0.0)

    def embed(self, tokens: int) -> float:
        if self.embed_overhead_s <= 0.0 and self.embed_per_token_s <= 0.0:
            return 0.0
        return self.embed_overhead_s + tokens * self.embed_per_token_s


PROFILES: dict[str, Profile] = {
    # Llama-3.1-8B-Instruct, BF16, one H100 SXM (docs/simulator.md has the sources):
    # 16.1 GB of weights at ~2.4 TB/s effective -> 6.6 ms per pass; 16 GFLOP per token
    # at ~545 TFLOPS (55% of BF16 dense peak) -> 29.5 us per token (~34k prefill
    # tokens/s); 128 KiB of KV per token (32 layers x 8 KV heads x 128 x 2 x 2 bytes)
    # at the same bandwidth -> 54 ns per context token. Batch-1 ITL ~7.4 ms, batch-8
    # ~7.8 ms (vLLM's H100 latency benchmark: 997.5 ms for 32 in / 128 out at batch 8).
    # vLLM's H100 default for the OpenAI server: 8192 batched tokens, 1024 sequences;
    # max_num_seqs stays 16 and the KV cache 4096 blocks (a real H100 holds ~27k) so
    # saturation and prefix eviction show at the scale a 2-core fleet bench can drive.
    "h100-8b": Profile(
        name="h100-8b",
        frontend_s=0.010,
        step_overhead_s=0.0008,
        weight_read_s=0.0066,
        token_compute_s=0.0000295,
        per_seq_s=0.00004,
        kv_read_per_token_s=0.000000054,
        step_jitter=0.03,
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        num_gpu_blocks=4096,
        max_model_len=8192,
        embed_overhead_s=0.005,
        embed_per_token_s=0.00002,
    ),
    # Zero latency for functional tests; the engine still yields between steps.
    "fast": Profile(
        name="fast",
        frontend_s=0.0,
        step_overhead_s=0.0,
        weight_read_s=0.0,
        token_compute_s=0.0,
        per_seq_s=0.0,
        kv_read_per_token_s=0.0,
        step_jitter=0.0,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        num_gpu_blocks=8192,
        max_model_len=8192,
        embed_overhead_s=0.0,
        embed_per_token_s=0.0,
    ),
    # Mirrors the CPU vLLM peer (bench/peers/vllm.sh: a 2-layer, 128-wide random
    # Llama in float32, --max-num-seqs 4, vLLM's CPU default of 2048 batched tokens),
    # fitted end to end (the simulator's own HTTP cost included) to what
    # bench/sim_shape.py measured of it: ~13 ms TTFT for one 400-token prompt and
    # ~5 ms more per prompt sharing the step; ~1.8 ms ITL alone, more with the batch.
    # The model is tiny: no weight or KV read to speak of, the step is overhead.
    "cpu-tiny": Profile(
        name="cpu-tiny",
        frontend_s=0.0025,
        step_overhead_s=0.0016,
        weight_read_s=0.0,
        token_compute_s=0.0000125,
        per_seq_s=0.00005,
        kv_read_per_token_s=0.0,
        step_jitter=0.05,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        num_gpu_blocks=512,
        max_model_len=1024,
        embed_overhead_s=0.005,
        embed_per_token_s=0.0002,
    ),
}

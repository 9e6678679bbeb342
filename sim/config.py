"""Simulator configuration: a profile gives the defaults, explicit fields override them."""

from __future__ import annotations

import msgspec

from sim.faults import parse_fault
from sim.profiles import PROFILES, Profile


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "sim-8b"
    # More names the same engine answers to (vLLM: several --served-model-name).
    aliases: tuple[str, ...] = ("sim-embed",)
    # LoRA adapters served on top of ``model`` (vLLM: --lora-modules): listed in
    # /v1/models with ``parent`` = ``model``; their text differs from the base's.
    loras: tuple[str, ...] = ()
    profile: str = "h100-8b"
    seed: int = 0
    # Fault draws only (None: ``seed``): replicas of one model share ``seed`` (the
    # same text) but fault independently.
    fault_seed: int | None = None
    max_num_seqs: int | None = None  # None: the profile's value
    max_num_batched_tokens: int | None = None  # a step's token budget (chunked prefill)
    num_gpu_blocks: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    embedding_dim: int = 384
    # The embeddings encodings taken: some OpenAI-compatible engines answer
    # ``encoding_format: base64`` with a 400 (a worker then asks for floats).
    embedding_encodings: tuple[str, ...] = ("float", "base64")
    # What /version (and TGI's /info) report: a new engine build to a worker.
    engine_version: str = "0.0.0+jetserve.sim"
    # fault spec ("429", "drop:3", "slow:50", ...) -> probability per request; sum <= 1
    fault_rates: dict[str, float] = msgspec.field(default_factory=dict)
    scripts_path: str | None = None
    # vLLM's KV cache events (sim/kv_events.py): a ZMQ PUB endpoint to bind
    # (``tcp://*:5557``), None: off. Replica i of ``--replicas N`` binds port + i.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv-events"

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {sorted(PROFILES)}")
        for name, value in (
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("num_gpu_blocks", self.num_gpu_blocks),
            ("max_model_len", self.max_model_len),
            ("block_size", self.block_size),
            ("embedding_dim", self.embedding_dim),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.embedding_encodings or set(self.embedding_encodings) - {"float", "base64"}:
            raise ValueError(
                f"embedding encodings are float and base64: {self.embedding_encodings}"
            )
        clash = set(self.loras) & {self.model, *self.aliases}
        if clash or len(set(self.loras)) != len(self.loras):
            raise ValueError(
                f"a LoRA adapter needs a name of its own: {sorted(clash) or self.loras}"
            )
        for spec, rate in self.fault_rates.items():
            parse_fault(spec)  # raises ValueError on a bad spec
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate for {spec!r} must be in [0, 1], got {rate}")
        if sum(self.fault_rates.values()) > 1.0 + 1e-9:
            raise ValueError("fault rates must sum to <= 1 (faults are mutually exclusive)")

    @property
    def base_profile(self) -> Profile:
        return PROFILES[self.profile]

    @property
    def eff_max_num_seqs(self) -> int:
        return self.max_num_seqs or self.base_profile.max_num_seqs

    @property
    def eff_max_num_batched_tokens(self) -> int:
        return self.max_num_batched_tokens or self.base_profile.max_num_batched_tokens

    @property
    def eff_num_gpu_blocks(self) -> int:
        return self.num_gpu_blocks or self.base_profile.num_gpu_blocks

    @property
    def eff_max_model_len(self) -> int:
        return self.max_model_len or self.base_profile.max_model_len

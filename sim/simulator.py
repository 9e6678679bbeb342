"""The Simulator: every piece of one simulated engine, owned by one object per app."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Any

import msgspec

from sim.clock import Clock
from sim.config import SimConfig
from sim.engine import Engine
from sim.faults import Fault, FaultPicker
from sim.inbound import BadRequest, NotFound
from sim.kv import BlockManager
from sim.kv_events import KvEventSink, ZmqPublisher
from sim.metrics import SimMetrics
from sim.records import Counters, RequestLog, RequestRecord
from sim.scripts import ScriptBook
from sim.tokenizer import VOCAB_SIZE, Tokenizer


class Simulator:
    def __init__(self, cfg: SimConfig, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.model = cfg.model
        # LoRA adapters: those it starts with, and those loaded or unloaded at
        # run time (vLLM's /v1/load_lora_adapter, sim/app.py).
        self.loras: list[str] = list(cfg.loras)
        self.profile = cfg.base_profile
        self.max_num_seqs = cfg.eff_max_num_seqs
        self.max_model_len = cfg.eff_max_model_len
        self.created = int(time.time())
        self.tokenizer = Tokenizer()
        self.kv_publisher: ZmqPublisher | None = None
        sink = None
        if cfg.kv_events_endpoint:
            self.kv_publisher = ZmqPublisher(cfg.kv_events_endpoint, cfg.kv_events_topic)
            sink = KvEventSink(self.kv_publisher)
        self.kv = BlockManager(cfg.eff_num_gpu_blocks, cfg.block_size, sink)
        self.records = RequestLog()
        self.stats = Counters()
        self.metrics = SimMetrics(
            cfg.model,
            cache_info={
                "block_size": str(cfg.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": "True",
                "gpu_memory_utilization": "0.9",
                "num_cpu_blocks": "0",
                "num_gpu_blocks": str(cfg.eff_num_gpu_blocks),
                "prefix_caching_hash_algo": "builtin",
            },
            running=lambda: len(self.engine.running),
            waiting=lambda: len(self.engine.waiting),
            kv_usage=self.kv.usage,
        )
        self.engine = Engine(
            self.profile,
            self.max_num_seqs,
            self.kv,
            self.metrics,
            self.records,
            self.stats,
            cfg.seed,
            cfg.eff_max_num_batched_tokens,
            clock,
        )
        fault_seed = cfg.seed if cfg.fault_seed is None else cfg.fault_seed
        self.faults = FaultPicker(cfg.fault_rates, fault_seed)
        self.scripts = ScriptBook.from_file(cfg.scripts_path)
        # Embedding requests share the engine's concurrency limit, not its KV blocks.
        self.embed_slots = asyncio.Semaphore(self.max_num_seqs)

    def close(self) -> None:
        """Unbind the KV events socket (the HTTP side is the server's)."""
        if self.kv_publisher is not None:
            self.kv_publisher.close()

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model
        if model not in self.served_models:
            raise NotFound(f"The model `{model}` does not exist.", "model")
        return model

    def text_seed(self, model: str | None) -> int:
        """The seed of ``model``'s natural text: the base's, or for a LoRA adapter
        one derived from its name (the same every run, never the base's)."""
        if not model or model not in self.loras:
            return self.cfg.seed
        digest = hashlib.blake2b(f"lora/{self.cfg.seed}/{model}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "big")

    @property
    def served_models(self) -> tuple[str, ...]:
        return (self.cfg.model, *self.cfg.aliases, *self.loras)

    @staticmethod
    def request_id(headers: Any) -> str:
        # vLLM honours X-Request-Id too and builds "chatcmpl-<id>" from it. A test
        # hook names the record itself, through a gateway that sets its own id
        # (X-Sim-Request-Id, forwarded like every x-sim- header).
        rid = headers.get("x-sim-request-id") or headers.get("x-request-id")
        return str(rid) if rid else uuid.uuid4().hex

    def pick_fault(self, header: str | None) -> Fault | None:
        try:
            fault = self.faults.pick(header)
        except ValueError as e:
            raise BadRequest(f"invalid X-Sim-Fault: {e}") from None
        if fault is not None:
            self.stats.faults[fault.spec] = self.stats.faults.get(fault.spec, 0) + 1
        return fault

    def new_record(self, request_id: str, endpoint: str, fault: Fault | None) -> RequestRecord:
        self.stats.requests += 1
        return RequestRecord(
            id=request_id,
            endpoint=endpoint,
            arrived_at=time.time(),
            fault=fault.spec if fault else None,
        )

    def record_failure(self, rec: RequestRecord, reason: str) -> None:
        """A request that failed before reaching the engine (an injected status fault)."""
        rec.status = "failed"
        rec.finish_reason = reason
        rec.finished_at = time.time()
        self.records.add(rec)
        self.stats.failed += 1

    def check_token_ids(self, ids: list[int]) -> None:
        if any(t < 0 or t >= VOCAB_SIZE for t in ids):
            raise BadRequest(f"token ids must be in [0, {VOCAB_SIZE})", "prompt")

    def check_length(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The effective max_tokens; 400 when the request cannot fit the context."""
        limit = self.max_model_len
        if prompt_tokens >= limit or (
            max_tokens is not None and prompt_tokens + max_tokens > limit
        ):
            asked = prompt_tokens + (max_tokens or 0)
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {asked} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion.",
                "messages",
            )
        if not self.engine.fits(prompt_tokens + 1):
            raise BadRequest(
                f"prompt of {prompt_tokens} tokens exceeds the KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size})",
                "messages",
            )
        return max_tokens if max_tokens is not None else limit - prompt_tokens

    def stats_view(self) -> bytes:
        view = msgspec.to_builtins(self.stats)
        view.update(
            running=len(self.engine.running),
            waiting=len(self.engine.waiting),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.used_blocks,
            kv_blocks_cached=self.kv.cached_blocks,
            kv_cache_usage=self.kv.usage(),
            records=len(self.records),
            script_rules=len(self.scripts),
            profile=self.profile.name,
            seed=self.cfg.seed,
            fault_seed=self.cfg.seed if self.cfg.fault_seed is None else self.cfg.fault_seed,
            model=self.model,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.engine.max_num_batched_tokens,
            steps=self.engine.steps,
        )
        return msgspec.json.encode(view)

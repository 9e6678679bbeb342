"""Pure units: block manager, tokenizer, text generator, stop scanner, profiles, config."""

from __future__ import annotations

import random

import pytest

from sim.completions import StopScanner
from sim.config import SimConfig
from sim.faults import Fault, FaultKind, FaultPicker, parse_fault
from sim.kv import BlockManager, chain_hashes
from sim.profiles import PROFILES
from sim.textgen import natural_pieces
from sim.tokenizer import Tokenizer


def _hashes(ids: list[int], bs: int = 4) -> list[int]:
    return chain_hashes(ids, bs, [])


def test_prefix_hits_need_the_same_parent_chain() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    a = list(range(10))  # 2 full blocks + 2 tokens
    got = kv.allocate(_hashes(a), kv.blocks_for(len(a)), (len(a) - 1) // 4)
    assert got is not None
    assert got[1] == 0
    assert kv.used_blocks == 3
    kv.free(got[0])
    assert kv.used_blocks == 0
    assert kv.usage() == 0.0
    assert kv.cached_blocks == 2
    # Same first block, different second: only one block hits.
    b = [0, 1, 2, 3, 9, 9, 9, 9, 1]
    got_b = kv.allocate(_hashes(b), 3, (len(b) - 1) // 4)
    assert got_b is not None
    assert got_b[1] == 1
    # Same second block content after a different first block: no hit (chained hash).
    c = [7, 7, 7, 7, 4, 5, 6, 7, 1]
    got_c = kv.allocate(_hashes(c), 3, 2)
    assert got_c is not None
    assert got_c[1] == 0


def test_never_a_full_prompt_hit() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    ids = list(range(8))  # exactly two blocks
    first = kv.allocate(_hashes(ids), 2, (len(ids) - 1) // 4)
    assert first is not None
    kv.free(first[0])
    again = kv.allocate(_hashes(ids), 2, (len(ids) - 1) // 4)
    assert again is not None
    assert again[1] == 1  # the last block is recomputed


def test_lru_eviction_and_capacity() -> None:
    kv = BlockManager(num_blocks=4, block_size=4)
    old = kv.allocate(_hashes([1] * 8), 2, 1)
    assert old is not None
    kv.free(old[0])
    assert kv.available == 4
    assert kv.evictable_blocks == 2
    big = kv.allocate(_hashes([2] * 16), 4, 3)  # needs every block: evicts the cached ones
    assert big is not None
    assert kv.cached_blocks == 4
    assert kv.usage() == 1.0
    assert kv.allocate(_hashes([3] * 4), 1, 0) is None
    assert kv.append() is None
    kv.free(big[0])
    assert kv.usage() == 0.0
    # The old prefix was evicted.
    again = kv.allocate(_hashes([1] * 8), 2, 1)
    assert again is not None
    assert again[1] == 0


def test_shared_blocks_are_refcounted() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    ids = list(range(9))
    a = kv.allocate(_hashes(ids), 3, 2)
    b = kv.allocate(_hashes(ids), 3, 2)
    assert a is not None
    assert b is not None
    assert b[1] == 2
    assert kv.used_blocks == 4  # two shared full blocks + one partial each
    kv.free(a[0])
    assert kv.used_blocks == 3
    kv.free(b[0])
    assert kv.used_blocks == 0


def test_tokenizer_is_lossless_and_stable() -> None:
    tok = Tokenizer()
    text = "  Hello, world!\n<|im_start|>user\nIt's 3.14  ok?  "
    pieces = tok.pieces(text)
    assert "".join(pieces) == text
    assert "\n<|im_start|>" in pieces
    assert " world" in pieces
    assert tok.encode(text) == Tokenizer().encode(text)
    assert all(0 <= t < 128256 for t in tok.encode(text))


def test_natural_text_is_deterministic_and_tokenizes_back() -> None:
    a = natural_pieces(1, [1, 2, 3], None)
    assert a == natural_pieces(1, [1, 2, 3], None)
    assert a != natural_pieces(2, [1, 2, 3], None)
    assert a != natural_pieces(1, [1, 2, 4], None)
    assert a != natural_pieces(1, [1, 2, 3], 9)
    assert 16 <= len(a) <= 64
    assert Tokenizer.pieces("".join(a)) == a  # completion_tokens == tokenize(content)
    assert len(natural_pieces(1, [1], None, length=300)) == 300


def test_stop_scanner_holds_back_partial_matches() -> None:
    s = StopScanner(["END"])
    assert s.push(" abc") == " a"
    assert s.push(" E") == "bc"  # " E" might start END: held back
    assert s.push("N") == " "  # "EN" still might
    assert s.push("D more") == ""
    assert s.matched == "END"
    assert s.text == " abc "
    plain = StopScanner([])
    assert plain.push(" x") == " x"
    assert plain.flush() == ""


def test_step_time_is_memory_bound_for_decodes_compute_bound_for_prefill() -> None:
    p = PROFILES["h100-8b"]
    one = p.step_time(1, 1, 100)  # one decode, 100 tokens of context
    eight = p.step_time(8, 8, 800)
    # Published: ~7.4 ms at batch 1, ~7.7 ms a step at batch 8 (docs/simulator.md).
    assert 0.0070 < one < 0.0078
    assert 0.0074 < eight < 0.0080
    # Decoding is about one read of the weights: 8x the batch is far from 8x the time.
    assert eight < 1.1 * one
    # The KV read grows with the context in the batch.
    assert p.step_time(8, 8, 8 * 8000) > eight + 0.003
    # A prefill chunk is compute-bound: its time grows with its tokens.
    assert p.step_time(4096, 1, 4096) > 1.9 * p.step_time(2048, 1, 2048) - p.step_overhead_s
    assert p.step_time(8192, 1, 8192) == pytest.approx(0.25, rel=0.1)  # ~34k tokens/s
    rng = random.Random(0)
    jittered = [p.step_time(1, 1, 100, rng) for _ in range(200)]
    assert min(jittered) >= one * (1 - p.step_jitter)
    assert max(jittered) <= one * (1 + p.step_jitter)
    assert PROFILES["fast"].step_time(8192, 64, 10**6, rng) == 0.0
    assert PROFILES["fast"].zero_latency
    assert not p.zero_latency


def test_config_overrides_and_validation() -> None:
    cfg = SimConfig(profile="fast", max_num_seqs=3)
    assert cfg.eff_max_num_seqs == 3
    assert cfg.eff_num_gpu_blocks == 8192
    assert SimConfig().eff_max_num_seqs == 16
    assert SimConfig().eff_max_num_batched_tokens == 8192
    assert SimConfig(max_num_batched_tokens=512).eff_max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SimConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="unknown profile 'nope'"):
        SimConfig(profile="nope")
    with pytest.raises(ValueError, match="must sum to <= 1"):
        SimConfig(fault_rates={"429": 0.7, "503": 0.7})
    with pytest.raises(ValueError, match="unknown fault 'boom'"):
        SimConfig(fault_rates={"boom": 0.1})


def test_fault_specs() -> None:
    assert parse_fault("drop:3") == Fault(FaultKind.DROP, 3)
    assert parse_fault("drop") == Fault(FaultKind.DROP, 0)
    assert parse_fault("stall") == Fault(FaultKind.STALL, None)
    assert parse_fault("stall:200").spec == "stall:200"
    assert parse_fault("429").status == 429
    for bad in ("slow", "429:1", "drop:x", "drop:-1", "meteor"):
        with pytest.raises(ValueError, match=f"{bad}'$"):
            parse_fault(bad)
    picker = FaultPicker({"503": 1.0}, seed=0)
    assert picker.pick(None) == Fault(FaultKind.UNAVAILABLE)
    assert picker.pick("none") is None
    assert picker.pick("slow:5") == Fault(FaultKind.SLOW, 5)

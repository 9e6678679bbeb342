"""The tiny random-weight model the real-vLLM test tier serves (recipe:
shared/peers/RECIPES.md): a byte-level BPE tokenizer (2048 tokens, ASCII, trained on
the Python stdlib sources) and a random Llama (128 hidden, 2 layers, seed 0), with a
Llama-3-style chat template (tiny_tokenizer.py). Run with the vLLM venv's python:

    OUT=$PEERS/tinyllama-ascii python bench/peers/make_tiny.py

Its replies are gibberish by design: the tier checks the wire, not the words.
"""

import json
import os
import time

import torch
from tiny_tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, UNK, train
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def main() -> None:
    t0 = time.time()
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    tok = train()
    hft = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=2048,
    )
    hft.chat_template = CHAT_TEMPLATE
    hft.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=hft.bos_token_id,
        eos_token_id=hft.eos_token_id,
        pad_token_id=hft.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    ids = {
        "bos_token_id": hft.bos_token_id,
        "eos_token_id": hft.eos_token_id,
        "pad_token_id": hft.pad_token_id,
    }
    with open(os.path.join(out, "generation_config.json"), "w") as fh:
        json.dump(ids, fh)
    params = sum(p.numel() for p in model.parameters())
    took = time.time() - t0
    print(f"tiny model: vocab {tok.get_vocab_size()}, {params} params, {out} ({took:.1f}s)")


if __name__ == "__main__":
    main()

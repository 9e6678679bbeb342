"""The tiny random-weight model the real-llama.cpp test tier serves: one GGUF file
written with the `gguf` package (GGUFWriter), no download and no conversion. The
tokenizer is the vLLM tier's (tiny_tokenizer.py: byte-level BPE, 2048 tokens, the
Llama-3-style chat template), stored in the GGUF metadata as a `gpt2` vocab with its
merges; the weights are a random Llama (128 hidden, 2 layers, seed 0, float32).
Run with the llama.cpp venv's python (needs gguf, numpy, tokenizers):

    OUT=$PEERS/tiny-llama.gguf python bench/peers/make_tiny_gguf.py

Its replies are gibberish by design: the tier checks the wire, not the words.
"""

import json
import os
import time

import numpy as np
from gguf import GGUFWriter, TokenType
from tiny_tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL, UNK, train

HIDDEN, LAYERS, HEADS, FFN, CONTEXT = 128, 2, 2, 256, 2048


def main() -> None:
    t0 = time.time()
    out = os.environ["OUT"]
    tok = train()
    vocab = tok.get_vocab()  # token -> id, byte-level strings as GPT-2 writes them
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [TokenType.CONTROL if t in SPECIAL else TokenType.NORMAL for t in tokens]

    w = GGUFWriter(out + ".tmp", "llama")
    w.add_name("tiny-llama-random")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(0)  # all float32
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[BOS])
    w.add_eos_token_id(vocab[EOS])
    w.add_pad_token_id(vocab[PAD])
    w.add_unk_token_id(vocab[UNK])
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    # numpy shapes are (out, in), as HF's Linear weights; GGUF stores them reversed.
    n = len(tokens)
    w.add_tensor("token_embd.weight", rand(n, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output.weight", rand(n, HIDDEN))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(HIDDEN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(out + ".tmp", out)
    size = os.path.getsize(out) / 1e6
    print(f"tiny gguf: vocab {n}, {size:.1f} MB, {out} ({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    main()

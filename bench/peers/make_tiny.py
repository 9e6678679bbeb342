"""The tiny random-weight model the real-vLLM test tier serves (recipe:
shared/peers/RECIPES.md): a byte-level BPE tokenizer (2048 tokens, ASCII, trained on
the Python stdlib sources) and a random Llama (128 hidden, 2 layers, seed 0), with a
Llama-3-style chat template. Run with the vLLM venv's python:

    OUT=$PEERS/tinyllama-ascii python bench/peers/make_tiny.py

Its replies are gibberish by design: the tier checks the wire, not the words.
"""

import glob
import json
import os
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL = [
    "<unk>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]


def corpus() -> list[str]:
    texts = []
    for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:200]:
        try:
            with open(f, encoding="utf-8") as fh:
                texts.append(fh.read())
        except (OSError, UnicodeDecodeError):
            continue  # a stdlib file that is not UTF-8: not needed
    greeting = "Hello! How are you today? I am a tiny test model. The quick brown fox jumps"
    texts += [greeting + " over the lazy dog."] * 50
    return [t.encode("ascii", "ignore").decode() for t in texts]


def main() -> None:
    t0 = time.time()
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    hft = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
        unk_token="<unk>",
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

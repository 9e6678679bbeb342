"""The tiny models' tokenizer, shared by make_tiny.py (safetensors, for vLLM) and
make_tiny_gguf.py (GGUF, for llama.cpp): a byte-level BPE of 2048 tokens, ASCII,
trained on the Python stdlib sources, and a Llama-3-style chat template. Needs only
the `tokenizers` package."""

import glob
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 2048
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
BOS, EOS, PAD, UNK = "<|begin_of_text|>", "<|eot_id|>", "<|pad|>", "<unk>"


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


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok

"""Exact per-input token counts without a network call: the model's own
tokenizer (a Hugging Face ``tokenizer.json``), loaded by the worker.

A batched embedding call gets one ``prompt_tokens`` total from the engine; each
request's share is the count of its own inputs (workers/inference/batching.py).
Asking the engine (vLLM's ``/tokenize``) costs one HTTP call per input: in front
of a real vLLM that was 1,599 tokenize calls per 398 embedding calls and halved
8-input throughput (issue 17). The same tokenizer in-process costs microseconds.

Counts are the engine's: special tokens included (vLLM adds them for an
embedding input unless the request's ``add_special_tokens`` is false, e.g.
BERT's [CLS] and [SEP]). The file's own truncation and padding (MiniLM's ships
with both fixed at 128) are turned off: the engine neither pads nor truncates
an input unless asked to, and the batcher checks the counts against the
engine's total anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.errors import TokenizerUnavailable

INSTALL_HINT = "pip install 'jetserve[embed]' (the `tokenizers` package)"


class LocalTokenCounter:
    """Counts tokens with a ``tokenizer.json``: ``path`` is the file or the model
    directory that holds it."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerUnavailable(f"--tokenizer needs {INSTALL_HINT}") from exc
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        try:
            tok: Any = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise TokenizerUnavailable(f"cannot load tokenizer {str(file)!r}: {exc}") from exc
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self.path = file

    async def count(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[int]:
        """Token count of each text, as the engine counts an embedding input. In
        a thread (the tokenizer releases the GIL): on the event loop, a batch of
        long inputs stalled it for seconds, and the worker's other streams went
        silent past the gateway's heartbeat timeout."""
        return await asyncio.to_thread(self.count_now, list(texts), add_special_tokens)

    def count_now(self, texts: list[str], add_special_tokens: bool = True) -> list[int]:
        encoded = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [len(e.ids) for e in encoded]

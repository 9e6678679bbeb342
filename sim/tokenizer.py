"""A deterministic, lossless toy tokenizer and a fixed ChatML-like chat template.

A token is a word or one punctuation mark, with the whitespace before it; special
markers like `<|im_start|>` are one token. Joining the pieces gives back the text
exactly, so streamed deltas reassemble to the non-stream content and token counts are
exact and reproducible.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from sim.inbound import ChatMessage

VOCAB_SIZE = 128256  # Llama-3 sized id space, so block hashes rarely collide

# Order matters: a special marker, a word, a punctuation mark (each with leading
# whitespace), then trailing whitespace. Every character starts one alternative, so
# the matches tile the text.
_PIECE = re.compile(r"\s*<\|[A-Za-z_]+\|>|\s*\w+|\s*[^\w\s]|\s+")

_CACHE_MAX = 1 << 16


class Tokenizer:
    def __init__(self) -> None:
        # Per-instance memo of piece -> id (no process-global state); bounded.
        self._ids: dict[str, int] = {}

    @staticmethod
    def pieces(text: str) -> list[str]:
        return _PIECE.findall(text)

    def token_id(self, piece: str) -> int:
        tid = self._ids.get(piece)
        if tid is None:
            digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
            tid = int.from_bytes(digest, "little") % VOCAB_SIZE
            if len(self._ids) >= _CACHE_MAX:
                self._ids.clear()
            self._ids[piece] = tid
        return tid

    def encode(self, text: str) -> list[int]:
        return [self.token_id(p) for p in _PIECE.findall(text)]


def render_chat(
    messages: Sequence[ChatMessage],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """ChatML-style template; tools and assistant tool calls are rendered as JSON."""
    out: list[str] = []
    if tools:
        out.append(f"<|im_start|>tools\n{json.dumps(list(tools), sort_keys=True)}<|im_end|>\n")
    for m in messages:
        body = m.text
        if m.tool_calls:
            calls = "".join(
                f"\n<tool_call>{json.dumps(c, sort_keys=True)}</tool_call>" for c in m.tool_calls
            )
            body += calls
        out.append(f"<|im_start|>{m.role}\n{body}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)

"""Token log-probabilities, deterministic: the same token at the same position
always gets the same figures, so a reply through the gateway can be compared
with the engine's own, field for field. Shapes are vLLM's (and OpenAI's):
chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``, and the legacy
completions' parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``)."""

from __future__ import annotations

import hashlib
from typing import Any

MAX_TOP = 20  # vLLM's default max_logprobs


class TokenLogprob:
    __slots__ = ("alternatives", "logprob", "token")

    def __init__(self, token: str, position: int, top: int) -> None:
        digest = hashlib.blake2b(f"{position}\0{token}".encode(), digest_size=2).digest()
        self.token = token
        # In (-4, 0]; the sampled token is the likeliest of its alternatives.
        self.logprob = -round(int.from_bytes(digest, "big") / 16384, 4)
        self.alternatives = [
            (token if j == 0 else f"{token}#{j}", round(self.logprob - 0.5 * j, 4))
            for j in range(top)
        ]


def chat(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for t, lp in e.alternatives
                ],
            }
            for e in entries
        ]
    }


def completion(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """``offset``: where the first entry's token starts in the whole reply text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "text_offset": offsets,
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [e.token for e in entries],
        "top_logprobs": [dict(e.alternatives) for e in entries],
    }

"""Token log-probabilities from a prompt-string engine, in OpenAI's shapes: chat's
``{"content": [{token, logprob, bytes, top_logprobs}]}`` and the completions API's
parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

:class:`Track` holds each token's figures until the text they belong to is released
(a stop string may still be cut), so the logprobs always spell the text sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streams.wire import Op


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def _chat(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in e.top
                ],
            }
            for e in entries
        ]
    }


class Track:
    """One choice's logprobs, released as its text is (``sent`` characters so far)."""

    def __init__(self, op: Op, offset: int = 0) -> None:
        self.chat = op == "chat"
        self.offset = offset  # the completions shape's text_offset of the next token
        self.pending: list[TokenLogprob] = []
        self.ends: list[int] = []  # each pending token's end, in characters of the text
        self.seen = 0  # characters of all tokens pushed
        self.released = 0  # characters of tokens released

    def push(self, entry: TokenLogprob) -> None:
        self.seen += len(entry.token)
        self.pending.append(entry)
        self.ends.append(self.seen)

    def take(self, sent: int) -> dict[str, Any] | None:
        """The tokens wholly inside the first ``sent`` characters, not yet released."""
        n = 0
        while n < len(self.pending) and self.ends[n] <= sent:
            n += 1
        if n == 0:
            return None
        entries, self.pending, self.ends = self.pending[:n], self.pending[n:], self.ends[n:]
        if self.chat:
            return _chat(entries)
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {
            "text_offset": offsets,
            "token_logprobs": [e.logprob for e in entries],
            "tokens": [e.token for e in entries],
            "top_logprobs": [dict(e.top) for e in entries],
        }


def wanted(op: Op, body: Any) -> int | None:
    """Alternatives per token the request asks for (None: no logprobs)."""
    value = body.get("logprobs")
    if op == "chat":
        return int(body.get("top_logprobs") or 0) if value else None
    if value is None or value is False:
        return None
    return int(value)

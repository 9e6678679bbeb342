"""Deterministic "model output": the same (seed, prompt, request seed) gives the same text."""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence

_TEXT = (
    "the model serves tokens from a queue while the gateway keeps budgets and every worker "
    "streams replies back over subjects with heartbeats so clients can resume after a "
    "restart and nothing is lost when one replica fails because messages are acked only "
    "once the first token is out latency grows with load yet prefix caching keeps repeated "
    "prompts cheap and blocks are evicted in least recently used order when memory runs "
    "short of what new requests need data plane control plane route contract deadline "
    "retry fallback hedge agent tool ledger approval tenant cache batch engine kernel"
)
_WORDS = tuple(_TEXT.split())

NATURAL_MIN = 16
NATURAL_MAX = 64


def _rng(seed: int, prompt_ids: Sequence[int], request_seed: int | None) -> random.Random:
    h = hashlib.blake2b(f"{seed}/{request_seed}".encode(), digest_size=16)
    h.update(array("q", prompt_ids).tobytes())
    return random.Random(int.from_bytes(h.digest(), "little"))


def vocabulary() -> list[str]:
    """Every piece natural text can hold (the words as they follow a space, plain and
    capitalised, and the full stop)."""
    words = [" " + w for w in dict.fromkeys(_WORDS)]
    return [*words, *(" " + w[1:].capitalize() for w in words), "."]


def natural_pieces(
    seed: int,
    prompt_ids: Sequence[int],
    request_seed: int | None,
    length: int | None = None,
    *,
    min_length: int = 0,
    distinct: bool = False,
    forced: str | None = None,
    banned: frozenset[str] = frozenset(),
) -> list[str]:
    """Output token pieces: words with a leading space, and now and then a full stop.

    `length` forces the count (ignore_eos); otherwise it is drawn from 16..64 and
    raised to `min_length` (min_tokens: no end of sequence before it). The sampling
    knobs: `distinct` draws no word twice while unused ones remain (a repetition,
    presence or frequency penalty), `forced` is the only piece drawn (a large
    positive logit bias), `banned` pieces are never drawn (a large negative one).
    """
    rng = _rng(seed, prompt_ids, request_seed)
    n = length if length is not None else max(rng.randint(NATURAL_MIN, NATURAL_MAX), min_length)
    if forced is not None:
        return [forced] * n
    out: list[str] = []
    used: set[str] = set()
    capital = True
    since_stop = 0
    while len(out) < n:
        if since_stop >= 6 and rng.random() < 0.15 and len(out) < n - 1 and "." not in banned:
            out.append(".")
            capital, since_stop = True, 0
            continue
        pool = [w for w in _WORDS if w not in used] if distinct else list(_WORDS)
        pool = [w for w in pool if _piece(w, capital) not in banned] or list(_WORDS)
        word = rng.choice(pool)
        used.add(word)
        out.append(_piece(word, capital))
        capital = False
        since_stop += 1
    return out


def _piece(word: str, capital: bool) -> str:
    return " " + (word.capitalize() if capital else word)

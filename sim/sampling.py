"""vLLM's sampling parameters, checked as vLLM checks them and applied to the
simulator's natural text in ways a test can see (the text is otherwise random):

- ``temperature`` 0, ``top_k`` 1 or ``min_p`` 1 leave one candidate per step: greedy,
  so the reply no longer depends on ``seed``;
- ``presence_penalty`` or ``frequency_penalty`` above 0, or ``repetition_penalty``
  above 1: no word is drawn twice while unused ones remain;
- ``logit_bias``: a bias of at least +10 makes that token the only choice, one of at
  most -10 removes it (only the natural vocabulary's tokens have an effect);
- ``min_tokens``: no end of sequence before that many tokens (a shorter scripted
  reply is continued with natural text).
"""

from __future__ import annotations

import msgspec

from sim.inbound import BadRequest, _Sampling
from sim.textgen import vocabulary
from sim.tokenizer import VOCAB_SIZE, Tokenizer

FORCE_BIAS = 10.0  # at least this: the only candidate; at most minus this: none


class Knobs(msgspec.Struct, frozen=True, kw_only=True):
    greedy: bool = False
    distinct: bool = False
    forced: str | None = None
    banned: frozenset[str] = frozenset()
    min_tokens: int = 0


def _check(req: _Sampling, max_tokens: int | None) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if not -2.0 <= value <= 2.0:
            raise BadRequest(f"{name} must be in [-2, 2], got {value}.", name)
    if req.repetition_penalty <= 0:
        raise BadRequest("repetition_penalty must be greater than zero.", "repetition_penalty")
    if req.temperature is not None and req.temperature < 0:
        raise BadRequest("temperature must be non-negative.", "temperature")
    if req.top_k is not None and req.top_k < -1:
        raise BadRequest("top_k must be -1 or 0 (disable), or at least 1.", "top_k")
    if not 0.0 <= req.min_p <= 1.0:
        raise BadRequest("min_p must be in [0, 1].", "min_p")
    if req.min_tokens < 0:
        raise BadRequest("min_tokens must be greater than or equal to 0.", "min_tokens")
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise BadRequest("min_tokens must be less than or equal to max_tokens.", "min_tokens")


def _bias(req: _Sampling) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias key {key!r} is not a token id.", "logit_bias") from None
        if not 0 <= token < VOCAB_SIZE:
            raise BadRequest(
                f"token_id(s) [{token}] in logit_bias contain out-of-vocab token ids.",
                "logit_bias",
            )
        out[token] = max(-100.0, min(100.0, float(value)))  # vLLM clamps, as OpenAI does
    return out


def knobs(req: _Sampling, max_tokens: int | None, tokenizer: Tokenizer) -> Knobs:
    """The request's sampling parameters, checked; what they change in the reply."""
    _check(req, max_tokens)
    bias = _bias(req)
    forced = banned = None
    if bias:
        by_id = {tokenizer.token_id(p): p for p in vocabulary()}
        top = max(bias, key=lambda t: bias[t])
        if bias[top] >= FORCE_BIAS and top in by_id:
            forced = by_id[top]
        banned = frozenset(by_id[t] for t, b in bias.items() if b <= -FORCE_BIAS and t in by_id)
    penalized = req.presence_penalty > 0 or req.frequency_penalty > 0
    return Knobs(
        greedy=req.temperature == 0 or req.top_k == 1 or req.min_p >= 1.0,
        distinct=penalized or req.repetition_penalty > 1,
        forced=forced,
        banned=banned or frozenset(),
        min_tokens=req.min_tokens,
    )

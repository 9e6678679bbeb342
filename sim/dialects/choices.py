"""What a dialect request asks the "model" for, in the engine's own terms: the sampling
knobs (checked and applied exactly as the OpenAI surface applies them, sim/sampling.py),
a structured-output target, ``n`` sequences, and ``ignore_eos``; and the output pieces of
each sequence, deterministically."""

from __future__ import annotations

import msgspec

from sim import structured
from sim.inbound import ApiError, _Sampling
from sim.sampling import Knobs, knobs
from sim.simulator import Simulator
from sim.textgen import natural_pieces


class DialectError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "validation") -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


class Spec(msgspec.Struct, frozen=True, kw_only=True):
    """The generation a dialect request asks for."""

    knobs: Knobs = Knobs()
    seed: int | None = None
    target: structured.Target | None = None
    n: int = 1
    ignore_eos: bool = False


def spec(
    sampling: _Sampling,
    max_tokens: int | None,
    sim: Simulator,
    *,
    target: structured.Target | None = None,
    n: int = 1,
    status: int = 422,
) -> Spec:
    """The dialect's parameters, checked as vLLM checks them (``status`` on a refusal)."""
    try:
        k = knobs(sampling, max_tokens, sim.tokenizer)
    except ApiError as e:
        raise DialectError(status, e.message) from None
    seed = None if k.greedy else sampling.seed  # one candidate per step: no seed
    return Spec(knobs=k, seed=seed, target=target, n=n, ignore_eos=sampling.ignore_eos)


def natural(
    sim: Simulator, prompt_ids: list[int], s: Spec, seed: int | None, length: int | None
) -> list[str]:
    k = s.knobs
    return natural_pieces(
        sim.cfg.seed,
        prompt_ids,
        seed,
        length,
        min_length=k.min_tokens,
        distinct=k.distinct,
        forced=k.forced,
        banned=k.banned,
    )


def pad(
    sim: Simulator, prompt_ids: list[int], pieces: list[str], at_least: int, s: Spec
) -> list[str]:
    """A scripted or structured reply shorter than ``at_least`` goes on with natural
    text (min_tokens, ignore_eos), as the OpenAI surface does."""
    missing = at_least - len(pieces)
    if missing <= 0:
        return pieces
    more = natural_pieces(sim.cfg.seed, prompt_ids, None, missing, distinct=s.knobs.distinct)
    return [*pieces, *more]


def sequence_seeds(s: Spec) -> list[int | None]:
    """The seed of each of the ``n`` sequences: the first is the request's; the others
    are derived from it, as the OpenAI surface derives them."""
    base = s.seed if s.seed is not None else 0
    greedy = s.knobs.greedy
    return [s.seed, *((None if greedy else base * 7919 + j) for j in range(1, s.n))]

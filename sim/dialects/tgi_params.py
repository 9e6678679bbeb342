"""TGI's ``parameters`` (router/src/lib.rs ``GenerateParameters``), checked as TGI's
router checks them (router/src/validation.rs), and what they ask of the simulated model.

Sampling is on when ``do_sample`` is set or any of temperature, top_k, top_p,
typical_p is; otherwise TGI decodes greedily (the seed changes nothing). A ``json``
grammar makes the reply a value of the schema; a ``regex`` grammar that is an
alternation of literals (``(?:a|b)``, as an adapter writes a choice) makes it one of
them; any other regex is refused rather than ignored.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from sim import structured
from sim.dialects.choices import DialectError, Spec, spec
from sim.inbound import MAX_CHOICES, _Sampling
from sim.logprobs import MAX_TOP
from sim.simulator import Simulator

MAX_BEST_OF = MAX_CHOICES  # TGI's --max-best-of (2 by default); the simulator's is 16
MAX_TOP_N_TOKENS = 5  # TGI's --max-top-n-tokens default
MAX_STOP_SEQUENCES = 4  # TGI's --max-stop-sequences default


class Grammar(msgspec.Struct, frozen=True):
    type: str
    value: Any = None


class TgiParameters(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    typical_p: float | None = None
    do_sample: bool = False
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = []
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool | None = None
    best_of: int | None = None
    top_n_tokens: int | None = None
    watermark: bool = False
    truncate: int | None = None
    grammar: Grammar | None = None


def _check(p: TgiParameters, stream: bool) -> None:
    """TGI's validation errors, word for word."""
    best_of = p.best_of or 1
    if best_of > 1 and not sampling(p):
        raise DialectError(422, "you must use sampling when `best_of` is > 1")
    if p.temperature is not None and p.temperature <= 0:
        raise DialectError(422, "`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise DialectError(422, "`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise DialectError(422, "`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise DialectError(422, "`top_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise DialectError(422, "`top_k` must be strictly positive")
    if p.max_new_tokens is not None and p.max_new_tokens < 1:
        raise DialectError(422, "`max_new_tokens` must be strictly positive")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise DialectError(
            422, f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}"
        )
    if best_of > 1 and p.seed is not None:
        raise DialectError(422, "`seed` must not be set when `best_of` > 1")
    if not 0 < best_of <= MAX_BEST_OF:
        raise DialectError(422, f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {best_of}")
    if stream and best_of != 1:
        raise DialectError(422, "`best_of` != 1 is not supported when streaming tokens")
    if stream and p.decoder_input_details:
        raise DialectError(
            422, "`decoder_input_details` == true is not supported when streaming tokens"
        )
    top_n = p.top_n_tokens or 0
    if not 0 <= top_n <= MAX_TOP_N_TOKENS:
        raise DialectError(
            422, f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {top_n}"
        )
    if p.grammar is not None and p.grammar.type not in ("json", "regex"):
        raise DialectError(422, f"unknown grammar type {p.grammar.type!r}")


def sampling(p: TgiParameters) -> bool:
    return p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))


def _literal_choices(pattern: str) -> list[str]:
    """The literals of a ``(?:a|b|c)`` regex; a DialectError for any other regex."""
    body = pattern[3:-1] if pattern.startswith("(?:") and pattern.endswith(")") else pattern
    parts = re.split(r"(?<!\\)\|", body)
    choices = [re.sub(r"\\(.)", r"\1", part) for part in parts]
    if not all(re.fullmatch(pattern, c) for c in choices):
        raise DialectError(422, "the simulator follows only regex grammars of literal choices")
    return choices


def _target(grammar: Grammar | None) -> structured.Target | None:
    if grammar is None:
        return None
    if grammar.type == "json":
        value = grammar.value if isinstance(grammar.value, dict) else structured.ANY_OBJECT
        return structured.Target(schema=value)
    if not isinstance(grammar.value, str):
        raise DialectError(422, "a regex grammar's value must be a string")
    return structured.Target(choices=_literal_choices(grammar.value))


def tgi_spec(sim: Simulator, p: TgiParameters, stream: bool) -> Spec:
    _check(p, stream)
    on = sampling(p)
    req = _Sampling(
        max_tokens=p.max_new_tokens,
        temperature=p.temperature if on else 0.0,  # no sampling: greedy
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
    )
    return spec(req, p.max_new_tokens, sim, target=_target(p.grammar), n=p.best_of or 1, status=422)


def top_n(p: TgiParameters) -> int:
    return min(p.top_n_tokens or 0, MAX_TOP)

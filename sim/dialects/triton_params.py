"""The vLLM backend's sampling parameters (Triton, generate extension): the
``sampling_parameters`` input, a JSON string of vLLM ``SamplingParams`` fields, or else
the request's ``parameters`` (scalars only). Checked and applied as vLLM checks them
(sim/sampling.py); a field ``SamplingParams`` does not have is refused, as its
constructor refuses it (``best_of`` is gone from vLLM V1). ``structured_outputs`` is
itself a JSON string (``{"json": schema}``, ``{"choice": [...]}``, ``{"json_object":
true}``); ``guided_decoding`` is its older name. ``logit_bias`` arrives with string keys
(JSON has no others), which vLLM compares with ints and fails on, as it does here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sim import structured
from sim.dialects.choices import DialectError, Spec, spec
from sim.inbound import MAX_CHOICES, ApiError, _Sampling
from sim.logprobs import MAX_TOP
from sim.simulator import Simulator


class TritonSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    stream: bool | None = None  # tolerated among the request's parameters
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: str | None = None
    guided_decoding: dict[str, Any] | str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    lora_name: str | None = None


def parse(raw: str | None, parameters: dict[str, Any]) -> TritonSampling:
    """The backend's rule: the ``sampling_parameters`` input wins over the parameters."""
    try:
        if raw is not None:
            return msgspec.json.decode(raw, type=TritonSampling)
        return msgspec.convert(parameters, TritonSampling)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise DialectError(400, f"[vllm] Invalid sampling parameters: {e}") from None


def _target(p: TritonSampling) -> structured.Target | None:
    raw: Any = p.structured_outputs if p.structured_outputs is not None else p.guided_decoding
    if raw is None:
        return None
    try:
        opts = msgspec.json.decode(raw) if isinstance(raw, str) else dict(raw)
        opts.pop("backend", None)
        return structured._from_structured_outputs(opts)
    except (msgspec.DecodeError, AttributeError, TypeError):
        raise DialectError(400, "structured_outputs must be a JSON object string") from None
    except ApiError as e:
        raise DialectError(400, e.message) from None


def triton_spec(sim: Simulator, p: TritonSampling) -> Spec:
    if p.logit_bias:
        # vLLM's own check, on the string keys JSON gives it.
        raise DialectError(400, "'<' not supported between instances of 'str' and 'int'")
    if not 1 <= p.n <= MAX_CHOICES:
        raise DialectError(400, f"n must be between 1 and {MAX_CHOICES}, got {p.n}.")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_TOP:
        raise DialectError(
            400,
            f"Requested sample logprobs of {p.logprobs}, which is greater than max "
            f"allowed: {MAX_TOP}",
        )
    req = _Sampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
    )
    return spec(req, p.max_tokens, sim, target=_target(p), n=p.n, status=400)


def stops(p: TritonSampling) -> list[str]:
    return [p.stop] if isinstance(p.stop, str) else [s for s in p.stop or [] if s]

"""One OpenAI/vLLM body as a request to Triton's vLLM backend (generate extension).

The backend takes vLLM's ``SamplingParams`` as the ``sampling_parameters`` input, a JSON
string (the request's ``parameters`` hold scalars only, so lists such as ``stop`` and
objects cannot go there), and its other inputs as top-level keys (``stream``,
``exclude_input_in_output``, ``return_*``). Every vLLM sampling field the corpus names is
carried by its own name; ``structured_outputs`` is itself a JSON string (``{"json":
schema}``, ``{"choice": [...]}``, ``{"regex": ...}``, ``{"json_object": true}``), built
from ``response_format`` and vLLM's guided options.

- ``n``: native (each output tensor holds one element per sequence);
- ``best_of`` (gone from vLLM V1): ``n = best_of`` with ``return_cumulative_logprob``,
  the ``n`` likeliest returned (emulated, the reply whole);
- ``logprobs`` / ``top_logprobs`` -> ``return_logprobs`` and ``logprobs`` (top k);
- ``echo``: the adapter sends the prompt ahead (the backend refuses
  ``exclude_input_in_output`` = false when streaming);
- tools: emulated as for TGI (:mod:`workers.engines.tool_emulation`), a forced call
  through ``structured_outputs``.

``logit_bias`` cannot reach vLLM this way: JSON keys are strings and the backend hands
them to vLLM unconverted, which then fails comparing them with ints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streams.wire import Op
from workers.engines import prompted
from workers.engines.constraints import Constraint, constraint
from workers.engines.token_logprobs import wanted
from workers.engines.tool_emulation import ToolPlan
from workers.errors import EngineRejected, EngineUnsupported

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
)
CARRIED = (
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "best_of",
    "echo",
    "logprobs",
    "top_logprobs",
    "response_format",
    "guided_json",
    "guided_choice",
    "guided_regex",
    "structured_outputs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    *_SAMPLING,
)
TRITON_LACKS = {
    "logit_bias": (
        "the backend passes JSON's string token ids to vLLM unconverted, which vLLM "
        "cannot compare with its vocabulary"
    ),
    "suffix": "vLLM has no insertion",
}


def _range(params: Mapping[str, Any], name: str, ok: Any, words: str) -> None:
    value = params.get(name)
    if value is not None and not ok(value):
        raise EngineRejected(f"{name} {words}, got {value}.")


def check_ranges(params: Mapping[str, Any], max_tokens: int | None) -> None:
    """vLLM's own range checks (``SamplingParams._verify_args``), made before sending:
    the backend logs vLLM's refusal and fails the request without its words."""
    for name in ("presence_penalty", "frequency_penalty"):
        _range(params, name, lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
    _range(params, "repetition_penalty", lambda v: v > 0, "must be greater than zero")
    _range(params, "temperature", lambda v: v >= 0, "must be non-negative")
    _range(params, "top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
    _range(params, "top_k", lambda v: v >= -1, "must be -1 (disable), or at least 1")
    _range(params, "min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]")
    _range(params, "min_tokens", lambda v: v >= 0, "must be greater than or equal to 0")
    if max_tokens is not None and params.get("min_tokens", 0) > max_tokens:
        raise EngineRejected("min_tokens must be less than or equal to max_tokens.")


def _structured(c: Constraint | None) -> str | None:
    if c is None:
        return None
    return json.dumps({{"json": "json", "choice": "choice", "regex": "regex"}[c.kind]: c.value})


class TritonRequest:
    def __init__(self, op: Op, body: Mapping[str, Any]) -> None:
        prompted.check_fields(body, CARRIED, "Triton", TRITON_LACKS)
        self.tool_plan = ToolPlan.of(body)
        if op == "chat":
            messages = list(body.get("messages") or [])
            self.prompt = prompted.render_chatml(messages, self.tool_plan.tools)
        elif isinstance(body.get("prompt"), str):
            self.prompt = str(body["prompt"])
        else:
            raise EngineRejected("the Triton adapter takes one prompt string")
        self.op = op
        self.top = wanted(op, body)
        self.n = int(body.get("n") or 1)
        self.echo = self.prompt if op == "completion" and body.get("echo") else ""
        if self.echo and self.top is not None:
            raise EngineUnsupported(
                "Triton cannot do echo with logprobs: the backend returns no prompt logprobs"
            )
        best_of = body.get("best_of")
        if best_of is not None and best_of < self.n:
            raise EngineRejected("best_of must be greater than or equal to n")
        self.best_of = int(best_of) if best_of is not None and best_of > self.n else None
        if self.best_of is not None and self.tool_plan.tools:
            raise EngineUnsupported("the Triton adapter's best_of takes no tools")
        self.stops = prompted.stop_list(body)
        self.sampling = self._sampling(body)

    def _sampling(self, body: Mapping[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
        check_ranges(params, prompted.max_tokens(body))
        limit = prompted.max_tokens(body)
        if limit is not None:
            params["max_tokens"] = limit
        if self.stops:
            params["stop"] = self.stops
        n = self.best_of or self.n
        if n > 1:
            params["n"] = n
        if self.top is not None:
            if not 0 <= self.top <= MAX_LOGPROBS:
                raise EngineRejected(f"logprobs must be between 0 and {MAX_LOGPROBS}")
            params["logprobs"] = self.top
        c = constraint(body, "Triton")
        if self.tool_plan.forced is not None:
            if c is not None:
                raise EngineRejected("one constraint at a time: tool_choice or a structured output")
            c = Constraint("json", self.tool_plan.forced)
        structured = _structured(c)
        if structured is not None:
            params["structured_outputs"] = structured
        return params

    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "text_input": self.prompt,
            "stream": True,
            "sampling_parameters": json.dumps(self.sampling),
            "exclude_input_in_output": True,
            "return_finish_reason": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
        }
        if self.top is not None:
            out["return_logprobs"] = True
        if self.best_of is not None:
            out["return_cumulative_logprob"] = True
        return out

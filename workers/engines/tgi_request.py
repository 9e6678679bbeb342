"""One OpenAI/vLLM body translated to TGI's ``/generate`` parameters
(router/src/lib.rs ``GenerateParameters``):

- ``max_tokens`` / ``max_completion_tokens`` -> ``max_new_tokens``; ``temperature``,
  ``top_p`` (1 means off: left out, TGI wants < 1), ``top_k`` (vLLM's -1/0 mean off),
  ``seed``, ``stop``, ``frequency_penalty``, ``repetition_penalty`` as they are;
  temperature 0 is TGI's greedy default (temperature and seed left out), any other
  (or none: OpenAI's default is 1) sets ``do_sample``;
- ``logprobs`` / ``top_logprobs`` -> every token's ``logprob`` and ``top_n_tokens``;
- structured output and forced tool calls -> ``grammar`` (``json`` or ``regex``; a
  choice becomes the regex of its escaped literals);
- ``best_of`` -> ``best_of`` on ``/generate`` (TGI refuses it when streaming), with
  ``decoder_input_details`` (the prompt's token count);
- ``n`` > 1: one request per choice (TGI makes one sequence per request), seeds
  ``seed + i``; ``echo``: the adapter sends the prompt ahead of each choice.

What TGI lacks is refused as 400 ``unsupported_parameter`` (:data:`TGI_LACKS`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from streams.wire import Op
from workers.engines import prompted
from workers.engines.constraints import Constraint, constraint
from workers.engines.token_logprobs import wanted
from workers.engines.tool_emulation import ToolPlan
from workers.errors import EngineRejected, EngineUnsupported

CARRIED = (
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "n",
    "best_of",
    "echo",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "guided_json",
    "guided_choice",
    "guided_regex",
    "structured_outputs",
)
TGI_LACKS = {
    "presence_penalty": "its parameters have frequency_penalty and repetition_penalty only",
    "min_p": "it has no min_p sampling",
    "min_tokens": "it has no minimum length",
    "ignore_eos": "it always stops at the end-of-sequence token",
    "logit_bias": "it has no logit bias",
    "suffix": "it has no insertion",
}
MAX_N = 16  # choices, each one TGI request (the gateway's cap too)
_META = re.compile(r"([.^$*+?{}\[\]\\|()])")


def regex_of(choices: list[str]) -> str:
    return "(?:" + "|".join(_META.sub(r"\\\1", c) for c in choices) + ")"


def _grammar(c: Constraint | None) -> dict[str, Any] | None:
    if c is None:
        return None
    if c.kind == "json":
        return {"type": "json", "value": c.value}
    if c.kind == "choice":
        return {"type": "regex", "value": regex_of(c.value)}
    return {"type": "regex", "value": c.value}


class TgiRequest:
    """One OpenAI body as TGI requests: :meth:`payload` for choice ``i``."""

    def __init__(self, op: Op, body: Mapping[str, Any]) -> None:
        prompted.check_fields(body, CARRIED, "TGI", TGI_LACKS)
        self.op = op
        self.tool_plan = ToolPlan.of(body)
        self.tools, self.forced = self.tool_plan.tools, self.tool_plan.forced
        if op == "chat":
            self.prompt = prompted.render_chatml(list(body.get("messages") or []), self.tools)
        elif isinstance(body.get("prompt"), str):
            self.prompt = str(body["prompt"])
        else:
            raise EngineRejected("the TGI adapter takes one prompt string")
        self.stops = prompted.stop_list(body)
        self.top = wanted(op, body)
        self.n = int(body.get("n") or 1)
        if not 1 <= self.n <= MAX_N:
            raise EngineRejected(f"n must be between 1 and {MAX_N}")
        self.echo = self.prompt if op == "completion" and body.get("echo") else ""
        if self.echo and self.top is not None:
            raise EngineUnsupported(
                "TGI cannot do echo with logprobs: the prompt's logprobs "
                "(decoder_input_details) are not given when streaming"
            )
        self.best_of = self._best_of(body)
        self.params = self._params(body)

    def _best_of(self, body: Mapping[str, Any]) -> int | None:
        best_of = body.get("best_of")
        if best_of is None or best_of == 1:
            return None
        if best_of < self.n:
            raise EngineRejected("best_of must be greater than or equal to n")
        if self.n > 1:
            raise EngineUnsupported(
                "TGI returns the one best of best_of sequences per request: best_of with "
                "n > 1 is not possible"
            )
        return int(best_of)

    def _params(self, body: Mapping[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {"details": True}
        limit = prompted.max_tokens(body)
        if limit is not None:
            params["max_new_tokens"] = limit
        for key in ("temperature", "seed", "frequency_penalty", "repetition_penalty"):
            if body.get(key) is not None:
                params[key] = body[key]
        if body.get("top_p") is not None and body["top_p"] < 1:
            params["top_p"] = body["top_p"]
        if body.get("top_k") is not None and body["top_k"] > 0:
            params["top_k"] = body["top_k"]
        if params.get("temperature") == 0:
            # TGI wants > 0; greedy is its default, and a seed means nothing to it.
            params.pop("temperature")
            params.pop("seed", None)
        else:
            # OpenAI samples unless temperature is 0 (its default is 1); TGI decodes
            # greedily unless told to sample.
            params["do_sample"] = True
        if self.stops:
            params["stop"] = self.stops
        if self.top:
            params["top_n_tokens"] = self.top
        grammar = _grammar(constraint(body, "TGI"))
        if self.forced is not None:
            if grammar is not None:
                raise EngineRejected("TGI takes one grammar: tool_choice or a structured output")
            grammar = {"type": "json", "value": self.forced}
        if grammar is not None:
            params["grammar"] = grammar
        if self.best_of is not None:
            params["best_of"] = self.best_of
            params["decoder_input_details"] = True  # the prompt's tokens, for usage
        return params

    def payload(self, i: int = 0) -> dict[str, Any]:
        params = self.params
        if i and params.get("seed") is not None:
            params = {**params, "seed": int(params["seed"]) + i}
        return {"inputs": self.prompt, "parameters": params}

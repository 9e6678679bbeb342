"""One OpenAI/vLLM body as llama.cpp's OpenAI-compatible server (``llama-cpp-python
[server]``, ``llama_cpp/server/types.py``) takes it.

That server's request models ignore fields they do not name (pydantic's default), and
name some they then ignore (``n``, ``best_of``), so a field it cannot do would vanish
without a word. Here each field is carried, re-expressed, emulated or refused with
400 ``unsupported_parameter`` (:data:`LLAMACPP_LACKS`):

- passed as they are: sampling (``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``seed``, presence / frequency penalties, ``logit_bias``, ``min_tokens``), ``stop``,
  ``logprobs`` / ``top_logprobs`` (chat's ``logprobs: true`` alone gets
  ``top_logprobs: 0``, without which the server gives none), ``suffix``, a named ``tool_choice``
  (llama.cpp forces the call with a grammar from the function's parameters);
- re-expressed: ``max_completion_tokens`` -> ``max_tokens``, ``repetition_penalty`` ->
  ``repeat_penalty``, ``response_format`` ``json_schema`` and vLLM's ``guided_json`` /
  ``structured_outputs.json`` (chat) -> ``response_format {"type": "json_object",
  "schema"}``, ``guided_choice`` / ``structured_outputs.choice`` -> a GBNF ``grammar``,
  ``tool_choice: "required"`` with one tool -> that tool named, text content parts ->
  one string;
- ``echo``: the server streams none; the adapter sends the prompt ahead of the text;
- ``n`` > 1: n requests (seeds ``seed + i``), merged by the adapter (workers/engines/fanout.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streams.wire import Op
from workers.engines import prompted
from workers.errors import EngineRejected, EngineUnsupported

CARRIED = (
    "messages",
    "n",
    "prompt",
    "suffix",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "guided_json",
    "guided_choice",
    "structured_outputs",
)
LLAMACPP_LACKS = {
    "ignore_eos": "its server always stops at the end-of-generation token",
    "guided_regex": "its grammars are GBNF, and it has no regex-to-GBNF converter",
}
MAX_N = 16  # choices, each one request (the gateway's cap too)


def gbnf_literal(text: str) -> str:
    return json.dumps(text)  # a GBNF string literal escapes as JSON does


def choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(gbnf_literal(c) for c in choices)


class LlamaCppRequest:
    """The body as llama.cpp's server takes it: :meth:`payload` for choice ``i``."""

    def __init__(self, op: Op, body: Mapping[str, Any]) -> None:
        prompted.check_fields(body, CARRIED, "llama.cpp", LLAMACPP_LACKS)
        self.op = op
        self.n = int(body.get("n") or 1)
        if not 1 <= self.n <= MAX_N:
            raise EngineRejected(f"n must be between 1 and {MAX_N}")
        best_of = body.get("best_of")
        if best_of not in (None, 1):
            raise EngineUnsupported(
                "llama.cpp cannot do best_of: its server takes the field and ignores it "
                "(one sequence per request); remove it or route to an engine that has it"
            )
        prompt = body.get("prompt")
        if op == "completion" and isinstance(prompt, list) and len(prompt) != 1:
            raise EngineUnsupported("llama.cpp's server takes one prompt per request")
        self.model = str(body.get("model") or "")
        # The server streams no echo: the adapter sends the prompt ahead of the text.
        text = prompt[0] if isinstance(prompt, list) else prompt
        self.echo = str(text or "") if op == "completion" and body.get("echo") else ""
        if self.echo and body.get("logprobs") is not None:
            raise EngineUnsupported(
                "llama.cpp cannot do echo with logprobs when streaming: the prompt's "
                "logprobs are not given"
            )
        self.base = self._translate(op, dict(body))

    def _translate(self, op: Op, out: dict[str, Any]) -> dict[str, Any]:
        out.pop("n", None)
        out.pop("best_of", None)
        out.pop("stream_options", None)
        out.pop("echo", None)
        if op == "chat" and out.get("logprobs") and out.get("top_logprobs") is None:
            # The server gives chat logprobs only with top_logprobs set.
            out["top_logprobs"] = 0  # its stream carries no usage: the adapter counts
        limit = out.pop("max_completion_tokens", None)
        if limit is not None:
            out["max_tokens"] = limit
        penalty = out.pop("repetition_penalty", None)
        if penalty is not None:
            out["repeat_penalty"] = penalty
        if op == "completion" and isinstance(out.get("prompt"), list):
            out["prompt"] = out["prompt"][0]
        if out.get("parallel_tool_calls") is not None:
            # llama.cpp makes at most one call per reply: false holds, true is moot.
            out.pop("parallel_tool_calls")
        self._structured(op, out)
        self._tools(out)
        if op == "chat":
            out["messages"] = [_message(m) for m in out.get("messages") or []]
        return out

    def _structured(self, op: Op, out: dict[str, Any]) -> None:
        outputs = dict(out.pop("structured_outputs", None) or {})
        schema = out.pop("guided_json", None) or outputs.pop("json", None)
        choices = out.pop("guided_choice", None) or outputs.pop("choice", None)
        if outputs:
            raise EngineUnsupported(
                f"llama.cpp cannot follow structured_outputs.{sorted(outputs)[0]}: "
                "only json and choice become its grammars"
            )
        fmt = out.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") or {}
            out.pop("response_format")
        if schema is not None:
            if op != "chat":
                raise EngineUnsupported(
                    "llama.cpp turns a JSON schema into its grammar on the chat API only"
                )
            out["response_format"] = {"type": "json_object", "schema": schema}
        if choices is not None:
            out["grammar"] = choice_grammar([str(c) for c in choices])

    def _tools(self, out: dict[str, Any]) -> None:
        tools = out.get("tools") or []
        if out.get("tool_choice") == "required" and tools:
            if len(tools) != 1:
                raise EngineUnsupported(
                    "llama.cpp can force a named tool only: tool_choice required with "
                    "several tools cannot be carried; name one"
                )
            out["tool_choice"] = {
                "type": "function",
                "function": {"name": tools[0]["function"]["name"]},
            }

    def payload(self, i: int) -> dict[str, Any]:
        if self.n == 1:
            return self.base
        seed = self.base.get("seed")
        return {**self.base, "seed": None if seed is None else int(seed) + i}


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Text parts joined into one string (its chat templates render strings); an image
    part is refused: the server's default chat handler renders text only."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise EngineUnsupported(
                f"llama.cpp's chat handler renders text only: a {kind} content part "
                "cannot be carried"
            )
        texts.append(str(part.get("text") or ""))
    return {**message, "content": "".join(texts)}

"""Translation loss vocabulary: what an adapter does with each request field or behaviour.

An adapter that is not a plain pass-through declares a ``translations`` table (row name ->
:class:`Translated`). The conformance runner reads it, then checks each claim against the
engine's actual behaviour: a field claimed as carried whose effect is missing is a
*silent drop*. Adapters without a table are taken to pass every field through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class FieldStatus(StrEnum):
    PASSED = "passed"  # sent to the engine as is; the engine does the work
    TRANSFORMED = "transformed"  # re-expressed in the dialect (same meaning)
    EMULATED = "emulated"  # the engine cannot do it; the adapter approximates it
    REJECTED = "rejected"  # the adapter refuses the request with a clear EngineRejected
    # A response detail or error the dialect has no way to express (TGI's API names no
    # model and reports no prefix-cache hits): nothing the client sent is dropped, the
    # detail is absent; the report says so instead of running the case.
    NOT_APPLICABLE = "not_applicable"


@dataclass(frozen=True, slots=True)
class Translated:
    status: FieldStatus
    note: str = ""


Translations = Mapping[str, Translated]

# Row names shared by adapters and the conformance corpus: request fields (or groups
# of them) and behaviours. One row may have several cases.
MESSAGES = "messages"
CONTENT_PARTS = "messages.content.image_url"
MAX_TOKENS = "max_tokens"
MAX_COMPLETION_TOKENS = "max_completion_tokens"
FINISH_REASON = "finish_reason"
TOOLS = "tools"
TOOL_CHOICE = "tool_choice"
PARALLEL_TOOL_CALLS = "parallel_tool_calls"
RESPONSE_FORMAT = "response_format"
STOP = "stop"
SEED = "seed"
TEMPERATURE = "temperature"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
LOGIT_BIAS = "logit_bias"
LOGPROBS = "logprobs"
N = "n"
ECHO = "echo"
BEST_OF = "best_of"
TOP_K = "top_k"
MIN_P = "min_p"
MIN_TOKENS = "min_tokens"
REPETITION_PENALTY = "repetition_penalty"
IGNORE_EOS = "ignore_eos"
STRUCTURED_OUTPUTS = "guided_json/guided_choice/structured_outputs"
USAGE = "stream_options.include_usage"
CACHED_TOKENS = "usage.prompt_tokens_details.cached_tokens"
CANCELLATION = "cancellation"
ERR_CONTEXT = "error.context_length"
ERR_MODEL = "error.404_model"
ERR_INVALID = "error.invalid_parameter"
ERR_429 = "error.429"
ERR_5XX = "error.5xx"
ERR_MALFORMED = "error.malformed_chunk"

ROWS = (
    MESSAGES,
    CONTENT_PARTS,
    MAX_TOKENS,
    MAX_COMPLETION_TOKENS,
    FINISH_REASON,
    TOOLS,
    TOOL_CHOICE,
    PARALLEL_TOOL_CALLS,
    RESPONSE_FORMAT,
    STOP,
    SEED,
    TEMPERATURE,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    LOGIT_BIAS,
    LOGPROBS,
    N,
    ECHO,
    BEST_OF,
    TOP_K,
    MIN_P,
    MIN_TOKENS,
    REPETITION_PENALTY,
    IGNORE_EOS,
    STRUCTURED_OUTPUTS,
    USAGE,
    CACHED_TOKENS,
    CANCELLATION,
    ERR_CONTEXT,
    ERR_MODEL,
    ERR_INVALID,
    ERR_429,
    ERR_5XX,
    ERR_MALFORMED,
)


def declared(adapter: object, row: str) -> Translated:
    """The adapter's claim for `row`; no table (or no entry) means a plain pass-through."""
    table: Translations = getattr(adapter, "translations", {})
    return table.get(row, Translated(FieldStatus.PASSED))

"""The checks of the conformance corpus: does the field's effect show in the answer?

Each check raises :class:`CheckFailed` when the request succeeded without the effect
(a silent drop), :class:`CutShort` when the effect is there but the reply was cut at
max_tokens, and :class:`CaseBroken` when the case itself proves nothing (its control
request shows no difference). Checks marked "sim" in ``corpus.Check`` are strict only
on the simulator, whose replies are deterministic; a real model gets the checks that
hold for any model.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from jetserve.conformance.corpus import Case, Check
from jetserve.conformance.json_prefix import is_json_prefix
from jetserve.conformance.outcome import Outcome
from workers.engines.base import Done


class CheckFailed(Exception):
    """The request succeeded but the field's effect is missing."""


class CutShort(Exception):
    """The field's effect is there but the reply was cut at max_tokens (a JSON
    reply that is valid so far): carried, with a note."""


class CaseBroken(Exception):
    """The case's control request shows the same thing: the case proves nothing."""


@dataclass
class Ctx:
    case: Case
    exp: dict[str, Any]  # the case's expect, filled
    sim: bool
    again: Callable[[dict[str, Any]], Awaitable[Outcome]]  # the body with these changes
    record: Callable[[], Awaitable[dict[str, Any]]]  # the simulator's record of it


def _done(out: Outcome) -> Done:
    if out.done is None:
        raise CheckFailed("no Done event")
    return out.done


def _words(text: str) -> list[str]:
    return [w.lower() for w in text.replace(".", " ").split()]


async def _text(ctx: Ctx, out: Outcome) -> None:
    done = _done(out)
    if not out.text or done.finish_reason not in ("stop", "length"):
        raise CheckFailed(f"no text or odd finish {done.finish_reason!r}")
    want = ctx.exp.get("sim_text")
    if ctx.sim and want is not None and out.text != want:
        raise CheckFailed(f"reply {out.text[:80]!r}, expected {want!r}")


async def _length(ctx: Ctx, out: Outcome) -> None:
    done, limit = _done(out), ctx.exp["max_tokens"]
    if done.usage.completion_tokens > limit:
        raise CheckFailed(f"{done.usage.completion_tokens} tokens > max_tokens {limit}")
    if ctx.sim and done.finish_reason != "length":
        raise CheckFailed(f"finish_reason {done.finish_reason!r}, expected 'length'")


async def _finish(ctx: Ctx, out: Outcome) -> None:
    done = _done(out)
    want = ctx.exp["finish"] if ctx.sim else None
    if done.finish_reason not in ("stop", "length") or (want and done.finish_reason != want):
        raise CheckFailed(f"finish_reason {done.finish_reason!r}, expected {want or 'stop/length'}")


async def _tool_call(ctx: Ctx, out: Outcome) -> None:
    done, exp = _done(out), ctx.exp
    calls = list(out.tool_calls.values())
    if not calls and not ctx.sim and ctx.case.model_decides and out.text:
        return  # the model chose to answer in text
    if not calls or calls[0].get("name") != exp["name"]:
        raise CheckFailed(f"no structured call to {exp['name']}; text {out.text[:80]!r}")
    try:
        args = json.loads(calls[0].get("arguments") or "null")
    except ValueError as exc:
        raise CheckFailed(f"tool arguments are not JSON: {exc}") from exc
    if not ctx.sim and done.finish_reason == "length":
        # vLLM forces `required` with a grammar for a list of calls: a random model
        # may go on adding calls until max_tokens. The first call is structured.
        raise CutShort(
            "cut at max_tokens after a structured call: the engine forced the call, "
            "the model did not close the list"
        )
    if ctx.sim and args != exp["arguments"]:
        raise CheckFailed(f"tool arguments {args!r} != {exp['arguments']!r}")
    # A forced tool_choice (named or required) may end "stop", as OpenAI's own API
    # does for a forced function; the structured call is what counts.
    choice = ctx.case.body.get("tool_choice")
    forced = isinstance(choice, dict) or choice == "required"
    if done.finish_reason != "tool_calls" and not (forced and done.finish_reason == "stop"):
        raise CheckFailed(f"finish_reason {done.finish_reason!r}, expected 'tool_calls'")


async def _no_tool_call(ctx: Ctx, out: Outcome) -> None:
    done = _done(out)
    if out.tool_calls or done.finish_reason == "tool_calls":
        names = [c.get("name") for c in out.tool_calls.values()]
        raise CheckFailed(f"a tool was called ({names}) although tool_choice is none")
    if not out.text:
        raise CheckFailed("no text")


async def _tool_calls(ctx: Ctx, out: Outcome) -> None:
    _done(out)
    calls = list(out.tool_calls.values())
    count, name = ctx.exp["count"], ctx.exp["name"]
    if not calls and not ctx.sim and ctx.case.model_decides and out.text:
        return  # the model chose to answer in text
    if any(c.get("name") != name for c in calls) or not calls:
        raise CheckFailed(f"calls {[c.get('name') for c in calls]}, expected {name}")
    if len(calls) > count or (ctx.sim and len(calls) != count):
        raise CheckFailed(f"{len(calls)} calls, expected {count}")


async def _json(ctx: Ctx, out: Outcome) -> None:
    done = _done(out)
    try:
        value = json.loads(out.text)
    except ValueError as exc:
        if done.finish_reason == "length" and is_json_prefix(out.text):
            # The grammar held; the model did not close the object in time.
            raise CutShort(
                "cut at max_tokens as valid JSON so far: the engine applied the "
                "format, the model did not close it"
            ) from exc
        raise CheckFailed(f"reply is not JSON: {out.text[:80]!r}") from exc
    keys = ctx.exp["keys"]
    if not isinstance(value, dict) or any(k not in value for k in keys):
        raise CheckFailed(f"JSON object with keys {keys} expected: {out.text[:80]!r}")


async def _choice(ctx: Ctx, out: Outcome) -> None:
    _done(out)
    if out.text.strip() not in ctx.exp["choices"]:
        raise CheckFailed(f"reply {out.text[:80]!r} is none of {ctx.exp['choices']}")


async def _stop(ctx: Ctx, out: Outcome) -> None:
    done, exp = _done(out), ctx.exp
    hit = [s for s in exp["stop"] if s in out.text]
    if hit:
        raise CheckFailed(f"stop string {hit[0]!r} in the reply")
    if ctx.sim and out.text != exp["sim_text"]:
        raise CheckFailed(f"reply {out.text!r}, expected {exp['sim_text']!r}")
    if ctx.sim and done.finish_reason != "stop":
        raise CheckFailed(f"finish_reason {done.finish_reason!r}, expected 'stop'")


async def _same_text(ctx: Ctx, out: Outcome) -> None:
    _done(out)
    other = await ctx.again(ctx.exp["vary"])
    if other.text != out.text:
        raise CheckFailed(f"{ctx.exp['vary'] or 'the same request'} changed the text")
    differ = ctx.exp.get("differ")
    if ctx.sim and differ is not None and (await ctx.again(differ)).text == out.text:
        raise CheckFailed(f"{differ} did not change the text")


async def _distinct(ctx: Ctx, out: Outcome) -> None:
    _done(out)
    if not out.text:
        raise CheckFailed("no text")
    if not ctx.sim:
        return
    words = _words(out.text)
    if len(set(words)) != len(words):
        raise CheckFailed(f"words repeat: {out.text[:80]!r}")
    control = _words((await ctx.again({ctx.exp["field"]: None})).text)
    if len(set(control)) == len(control):
        raise CaseBroken("without the penalty no word repeats either")


async def _bias(ctx: Ctx, out: Outcome) -> None:
    done = _done(out)
    if not out.text:
        raise CheckFailed("no text")
    want = ctx.exp["word"] * ctx.exp["tokens"]
    if ctx.sim and (out.text != want or done.finish_reason != "length"):
        raise CheckFailed(f"reply {out.text[:80]!r}, expected {want!r}")


async def _logprobs(ctx: Ctx, out: Outcome) -> None:
    done, top = _done(out), ctx.exp["top"]
    entries = out.choice(0).logprobs
    if not entries:
        raise CheckFailed("no logprobs in the reply")
    if any(n < top for _, n in entries) or (ctx.sim and any(n != top for _, n in entries)):
        raise CheckFailed(f"alternatives per token {[n for _, n in entries]}, expected {top}")
    if ctx.sim and len(entries) != done.usage.completion_tokens:
        raise CheckFailed(f"{len(entries)} logprobs for {done.usage.completion_tokens} tokens")
    if ctx.sim and "".join(tok for tok, _ in entries) != out.text:
        raise CheckFailed("the logprobs' tokens do not spell the reply")


async def _choices(ctx: Ctx, out: Outcome) -> None:
    _done(out)
    n = ctx.exp["n"]
    if sorted(out.choices) != list(range(n)):
        raise CheckFailed(f"choices {sorted(out.choices)}, expected indexes 0..{n - 1}")
    for i, c in out.choices.items():
        if not c.text or c.finish not in ("stop", "length"):
            raise CheckFailed(f"choice {i}: text {c.text[:40]!r}, finish {c.finish!r}")


async def _echo(ctx: Ctx, out: Outcome) -> None:
    _done(out)
    prompt = ctx.exp["prompt"]
    if not out.text.startswith(prompt) or len(out.text) <= len(prompt):
        raise CheckFailed(f"reply {out.text[:80]!r} does not start with the prompt")


async def _min_tokens(ctx: Ctx, out: Outcome) -> None:
    got = _done(out).usage.completion_tokens
    if got < ctx.exp["min"]:
        raise CheckFailed(f"{got} tokens < min_tokens {ctx.exp['min']}")


async def _exact_length(ctx: Ctx, out: Outcome) -> None:
    done = _done(out)
    got, want = done.usage.completion_tokens, ctx.exp["tokens"]
    if got != want or done.finish_reason != "length":
        raise CheckFailed(f"{got} tokens ending {done.finish_reason!r}, expected {want} 'length'")


async def _usage(ctx: Ctx, out: Outcome) -> None:
    u = _done(out).usage
    if u.prompt_tokens <= 0 or u.completion_tokens <= 0:
        raise CheckFailed(f"usage missing: {u.prompt_tokens}/{u.completion_tokens}")
    if ctx.sim:
        rec = await ctx.record()
        seen = (rec["prompt_tokens"], rec["generated_tokens"])
        if (u.prompt_tokens, u.completion_tokens) != seen:
            raise CheckFailed(f"usage {u.prompt_tokens}/{u.completion_tokens} != {seen}")


async def _cached(ctx: Ctx, out: Outcome) -> None:
    first = _done(out).usage
    second = _done(await ctx.again({})).usage
    if second.cached_tokens <= 0:
        raise CheckFailed(f"the same prompt again reported {second.cached_tokens} cached tokens")
    if second.cached_tokens > second.prompt_tokens or second.prompt_tokens != first.prompt_tokens:
        raise CheckFailed(f"cached {second.cached_tokens} of {second.prompt_tokens} prompt tokens")


CHECKS: dict[Check, Callable[[Ctx, Outcome], Awaitable[None]]] = {
    Check.TEXT: _text,
    Check.LENGTH: _length,
    Check.FINISH: _finish,
    Check.TOOL_CALL: _tool_call,
    Check.NO_TOOL_CALL: _no_tool_call,
    Check.TOOL_CALLS: _tool_calls,
    Check.JSON: _json,
    Check.CHOICE: _choice,
    Check.STOP: _stop,
    Check.SAME_TEXT: _same_text,
    Check.DISTINCT: _distinct,
    Check.BIAS: _bias,
    Check.LOGPROBS: _logprobs,
    Check.CHOICES: _choices,
    Check.ECHO: _echo,
    Check.MIN_TOKENS: _min_tokens,
    Check.EXACT_LENGTH: _exact_length,
    Check.USAGE: _usage,
    Check.CACHED: _cached,
}

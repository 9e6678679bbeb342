"""Planning a reply: which tokens the "model" will emit, scripted or generated.

Every event is one output token, so completion_tokens is the number of events emitted.
"""

from __future__ import annotations

import json
import uuid

import msgspec
from starlette.datastructures import Headers

from sim import constraints
from sim.inbound import (
    MAX_CHOICES,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    ScriptedResponse,
    check_sampling,
    logprobs_top,
    prompt_input,
    stop_list,
)
from sim.sampling import Knobs, knobs
from sim.scripts import Conversation, parse_response
from sim.simulator import Simulator
from sim.textgen import natural_pieces
from sim.tokenizer import render_chat


class Text(msgspec.Struct, frozen=True):
    piece: str


class ToolStart(msgspec.Struct, frozen=True):
    index: int
    id: str
    name: str


class ToolArgs(msgspec.Struct, frozen=True):
    index: int
    piece: str


class Thought(msgspec.Struct, frozen=True):
    """A reasoning token (``reasoning_content``), before the answer's."""

    piece: str


Event = Text | Thought | ToolStart | ToolArgs  # one output token each


def _scripted_events(sim: Simulator, resp: ScriptedResponse) -> tuple[list[Event], str]:
    events: list[Event] = [Thought(p) for p in sim.tokenizer.pieces(resp.reasoning or "")]
    events += [Text(p) for p in sim.tokenizer.pieces(resp.content or "")]
    for i, call in enumerate(resp.tool_calls or []):
        name = str(call.function.get("name", ""))
        args = call.function.get("arguments", "")
        args_text = args if isinstance(args, str) else json.dumps(args)
        call_id = call.id or f"chatcmpl-tool-{uuid.uuid4().hex}"
        events.append(ToolStart(i, call_id, name))
        events.extend(ToolArgs(i, p) for p in sim.tokenizer.pieces(args_text))
    if not events:
        events.append(Text(""))  # an empty reply is still one (end-of-sequence) token
    return events, "tool_calls" if resp.tool_calls else "stop"


def event_token(sim: Simulator, ev: Event) -> int:
    return sim.tokenizer.token_id(ev.name if isinstance(ev, ToolStart) else ev.piece)


def _script_for(sim: Simulator, headers: Headers, conv: Conversation) -> ScriptedResponse | None:
    header = headers.get("x-sim-script")
    if header is not None:
        return parse_response(header)
    return sim.scripts.pick(conv)


def _natural(
    sim: Simulator,
    prompt_ids: list[int],
    seed: int | None,
    length: int | None,
    k: Knobs,
    model: str | None,
) -> list[Event]:
    pieces = natural_pieces(
        sim.text_seed(model),
        prompt_ids,
        None if k.greedy else seed,  # one candidate per step: the seed changes nothing
        length,
        min_length=k.min_tokens,
        distinct=k.distinct,
        forced=k.forced,
        banned=k.banned,
    )
    return [Text(p) for p in pieces]


def _pad(
    sim: Simulator,
    events: list[Event],
    prompt_ids: list[int],
    at_least: int,
    k: Knobs,
    model: str | None,
) -> list[Event]:
    """A (scripted) reply shorter than ``at_least`` goes on with natural text."""
    missing = at_least - len(events)
    if missing <= 0:
        return events
    more = natural_pieces(sim.text_seed(model), prompt_ids, None, missing, distinct=k.distinct)
    return [*events, *(Text(p) for p in more)]


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    prompt_ids: list[int]
    events: list[Event]
    natural_finish: str
    max_tokens: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    more_choices: list[list[Event]] = []  # choices 1..n-1
    echo: str = ""  # the prompt, returned ahead of each choice's text (``echo``)
    cache_salt: str = ""  # vLLM's: its prefix cache is reused only within one salt


def _more_choices(
    sim: Simulator,
    req: ChatRequest | CompletionRequest,
    prompt_ids: list[int],
    scripted: list[Event] | None,
    forced: int | None,
    k: Knobs,
) -> list[list[Event]]:
    """Choices 1..n-1: a scripted reply repeats; natural ones differ, each drawn
    with its own seed derived from the request's (deterministic, as ``seed`` is)."""
    if scripted is not None:
        return [list(scripted) for _ in range(req.n - 1)]
    base = req.seed if req.seed is not None else 0
    return [
        _natural(sim, prompt_ids, base * 7919 + j, forced, k, req.model) for j in range(1, req.n)
    ]


def _reply(
    sim: Simulator,
    req: ChatRequest | CompletionRequest,
    script: ScriptedResponse | None,
    prompt_ids: list[int],
    max_tokens: int | None,
) -> tuple[list[Event], str, list[list[Event]]]:
    """The first choice's events, its natural finish, and the other choices."""
    k = knobs(req, max_tokens, sim.tokenizer)
    # ignore_eos: the reply runs past max_tokens, so it ends "length" as in vLLM.
    forced = max_tokens + 1 if req.ignore_eos and max_tokens is not None else None
    generated = constraints.generated_reply(req, prompt_ids)
    if script is not None:
        sim.stats.scripted += 1
    elif generated is not None:
        script = generated
    if script is not None:
        if isinstance(req, ChatRequest):
            script = constraints.obey_tool_choice(script, req)
        else:
            script = ScriptedResponse(content=script.content)
        events, finish = _scripted_events(sim, script)
        # min_tokens, and ignore_eos (no end of sequence before max_tokens), go on
        # past a shorter scripted reply.
        events = _pad(sim, events, prompt_ids, forced or k.min_tokens, k, req.model)
    else:
        events, finish = _natural(sim, prompt_ids, req.seed, forced, k, req.model), "stop"
    scripted = events if script is not None else None
    return events, finish, _more_choices(sim, req, prompt_ids, scripted, forced, k)


def plan_chat(sim: Simulator, req: ChatRequest, headers: Headers) -> Plan:
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    check_sampling(req, max_tokens)
    if not req.messages:
        raise BadRequest("messages must not be empty", "messages")
    prompt = render_chat(req.messages, req.tools, req.add_generation_prompt)
    prompt_ids = sim.tokenizer.encode(prompt)
    last = req.messages[-1]
    # last_user rules match a user turn only, so after a tool result the next rule applies.
    last_user = last.text if last.role == "user" else None
    conv = Conversation(last_user=last_user, last_role=last.role, prompt=prompt)
    script = _script_for(sim, headers, conv)
    events, finish, more = _reply(sim, req, script, prompt_ids, max_tokens)
    return _plan(req, prompt_ids, events, finish, max_tokens, more)


def plan_completion(sim: Simulator, req: CompletionRequest, headers: Headers) -> Plan:
    check_sampling(req, req.max_tokens)
    if req.suffix is not None:
        raise BadRequest("suffix is not currently supported", "suffix")  # as vLLM answers
    if req.best_of is not None and not req.n <= req.best_of <= MAX_CHOICES:
        raise BadRequest(f"best_of must be between n and {MAX_CHOICES}", "best_of")
    prompt = prompt_input(req.prompt)
    if isinstance(prompt, str):
        prompt_ids, text = sim.tokenizer.encode(prompt), prompt
    else:
        sim.check_token_ids(prompt)
        prompt_ids, text = prompt, ""
    conv = Conversation(last_user=text, last_role="user", prompt=text)
    script = _script_for(sim, headers, conv)
    events, _, more = _reply(sim, req, script, prompt_ids, req.max_tokens)
    plan = _plan(req, prompt_ids, events, "stop", req.max_tokens, more)
    if req.echo:
        # Token-id prompts have no text here (the tokenizer does not decode).
        plan = msgspec.structs.replace(plan, echo=text)
    return plan


def _plan(
    req: ChatRequest | CompletionRequest,
    prompt_ids: list[int],
    events: list[Event],
    finish: str,
    max_tokens: int | None,
    more_choices: list[list[Event]],
) -> Plan:
    opts = req.stream_options
    return Plan(
        prompt_ids=prompt_ids,
        events=events,
        natural_finish=finish,
        max_tokens=max_tokens,
        stops=stop_list(req.stop),
        stream=req.stream,
        include_usage=bool(req.stream and opts is not None and opts.include_usage),
        logprobs=logprobs_top(req),
        more_choices=more_choices,
        cache_salt=req.cache_salt or "",
    )

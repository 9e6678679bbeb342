"""What constrains a chat reply besides the script: ``tool_choice`` (``required`` or a
named function makes the model call it, as vLLM forces it with a grammar; ``none``
takes scripted calls away), ``parallel_tool_calls=false`` (one call at most) and the
structured-output options (sim/structured.py)."""

from __future__ import annotations

from typing import Any

from sim import structured
from sim.inbound import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    ScriptedResponse,
    ScriptedToolCall,
)


def obey_tool_choice(resp: ScriptedResponse, req: ChatRequest) -> ScriptedResponse:
    """tool_choice "none" takes the scripted calls away; parallel_tool_calls=false
    keeps the first."""
    calls = resp.tool_calls
    if not calls:
        return resp
    if req.tool_choice == "none":
        return ScriptedResponse(content=resp.content or "No tool is called.")
    if req.parallel_tool_calls is False and len(calls) > 1:
        return ScriptedResponse(content=resp.content, tool_calls=calls[:1])
    return resp


def _forced_tool(req: ChatRequest) -> dict[str, Any] | None:
    """The tool a ``required`` or named ``tool_choice`` makes the model call (vLLM
    forces it with a grammar), checked as vLLM checks it; None: the model decides."""
    choice = req.tool_choice
    if choice in (None, "none", "auto"):
        return None
    tools = [t.get("function") or {} for t in req.tools or []]
    if not tools:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required":
        return tools[0]
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name is None:
        raise BadRequest(f"Invalid tool_choice {choice!r}.", "tool_choice")
    for fn in tools:
        if fn.get("name") == name:
            return fn
    raise BadRequest(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")


def generated_reply(
    req: ChatRequest | CompletionRequest, prompt_ids: list[int]
) -> ScriptedResponse | None:
    """A forced tool call or a structured-output reply, as the constraint makes it."""
    fn = _forced_tool(req) if isinstance(req, ChatRequest) else None
    if fn is not None:
        args = structured.schema_value(fn.get("parameters") or structured.ANY_OBJECT)
        call = ScriptedToolCall(function={"name": fn.get("name", ""), "arguments": args or {}})
        return ScriptedResponse(tool_calls=[call])
    t = structured.target(
        req.response_format, req.guided_json, req.guided_choice, req.structured_outputs
    )
    if t is None:
        return None
    return ScriptedResponse(content=structured.render(t, sum(prompt_ids)))

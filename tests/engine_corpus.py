"""The conformance corpus as the real-engine tiers (tests/vllm, tests/llamacpp) run it."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from jetserve.conformance.corpus import CASES, Case


def _pinned(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every property pinned to one value (an enum)."""
    values = {"city": "Paris", "temp_c": 21}
    props = {k: {"enum": [values.get(k, "x")]} for k in schema["properties"]}
    return {**schema, "properties": props}


def _pin_schemas(body: dict[str, Any]) -> None:
    """Every JSON schema of the body (response_format, vLLM's structured-output options,
    tool parameters) pinned in place."""
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        fmt["json_schema"]["schema"] = _pinned(fmt["json_schema"]["schema"])
    if isinstance(body.get("guided_json"), dict):
        body["guided_json"] = _pinned(body["guided_json"])
    outputs = body.get("structured_outputs") or {}
    if isinstance(outputs.get("json"), dict):
        outputs["json"] = _pinned(outputs["json"])
    for tool in body.get("tools") or []:
        tool["function"]["parameters"] = _pinned(tool["function"]["parameters"])


def real_engine_cases(extra: dict[str, dict[str, Any]] | None = None) -> tuple[Case, ...]:
    """The corpus, with the grammar-bound cases' schemas pinned to enums. With
    random weights, a free JSON string never closes within max_tokens, so the reply
    would be cut (finish `length`) and fail to parse even though vLLM enforced the
    grammar; pinned, only the grammar decides the reply, so it proves the field was
    carried. (vLLM runs with disable_any_whitespace for the same reason.)

    ``extra``: case name -> fields added to its body for this engine."""
    out = []
    for case in CASES:
        body = copy.deepcopy(case.body)
        _pin_schemas(body)
        body.update((extra or {}).get(case.name, {}))
        out.append(dataclasses.replace(case, body=body))
    return tuple(out)

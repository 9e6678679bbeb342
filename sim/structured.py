"""Structured output, deterministically: a JSON value that satisfies a (simple) JSON
schema, or one of a fixed list of choices. The OpenAI surface applies it for
``response_format`` (``json_object``, ``json_schema``) and vLLM's structured-output
options (``guided_json``, ``guided_choice``, ``structured_outputs``); TGI's
``parameters.grammar`` of type json uses the same values. A scripted reply wins
over all of it (the scripts are the tests' hook)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from sim.inbound import BadRequest

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class Target(msgspec.Struct, frozen=True):
    """What the reply must be: a JSON document for ``schema``, or one of ``choices``."""

    schema: dict[str, Any] | None = None
    choices: list[str] | None = None


def schema_value(schema: Any) -> Any:
    """A deterministic value that satisfies a (simple) JSON schema."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return schema_value(schema[key][0])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {name: schema_value(sub) for name, sub in props.items()}
    if kind == "array":
        return [schema_value(schema.get("items"))]
    return {"string": "sim", "number": 1.5, "integer": 1, "boolean": True}.get(str(kind))


def _schema_of(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):  # vLLM takes a schema as a JSON string too
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise BadRequest(f"{param} is not valid JSON", param) from None
    if not isinstance(value, dict):
        raise BadRequest(f"{param} must be a JSON schema object", param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise BadRequest(f"{param} must be a non-empty list of strings", param)
    return list(value)


def _from_response_format(fmt: dict[str, Any]) -> Target | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Target(schema=ANY_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequest("response_format.json_schema is required", "response_format")
        return Target(schema=_schema_of(spec.get("schema", ANY_OBJECT), "response_format"))
    raise BadRequest(f"response_format type {kind!r} is not supported", "response_format")


def _from_structured_outputs(opts: dict[str, Any]) -> Target:
    known = {k: v for k, v in opts.items() if v not in (None, False)}
    if len(known) != 1:
        raise BadRequest("structured_outputs takes exactly one option", "structured_outputs")
    ((key, value),) = known.items()
    if key == "json":
        return Target(schema=_schema_of(value, "structured_outputs.json"))
    if key == "json_object":
        return Target(schema=ANY_OBJECT)
    if key == "choice":
        return Target(choices=_choices(value, "structured_outputs.choice"))
    # regex, grammar, structural_tag: not simulated; refused rather than ignored.
    raise BadRequest(f"structured_outputs.{key} is not supported by the simulator", key)


def target(
    response_format: dict[str, Any] | None,
    guided_json: Any,
    guided_choice: Any,
    structured_outputs: dict[str, Any] | None,
) -> Target | None:
    """The request's one structured-output constraint (None: free text)."""
    found: list[Target] = []
    if response_format is not None:
        t = _from_response_format(response_format)
        if t is not None:
            found.append(t)
    if guided_json is not None:
        found.append(Target(schema=_schema_of(guided_json, "guided_json")))
    if guided_choice is not None:
        found.append(Target(choices=_choices(guided_choice, "guided_choice")))
    if structured_outputs is not None:
        found.append(_from_structured_outputs(structured_outputs))
    if len(found) > 1:
        raise BadRequest("only one kind of structured output may be requested", "response_format")
    return found[0] if found else None


def render(t: Target, pick: int) -> str:
    """The reply's text: the schema's value as JSON, or choice ``pick`` (modulo)."""
    if t.choices is not None:
        return t.choices[pick % len(t.choices)]
    value = schema_value(t.schema)
    if value == {} and not (t.schema or {}).get("properties"):
        value = {"answer": "sim"}  # a bare object schema: any object will do
    return json.dumps(value)

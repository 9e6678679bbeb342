"""The structured-output constraint of an OpenAI/vLLM request, in neutral form, for the
prompt-string adapters to re-express in their engine's terms (TGI's grammar, the vLLM
backend's ``structured_outputs``): ``response_format`` (json_object, json_schema) and
vLLM's options (``guided_json``, ``guided_choice``, ``guided_regex``,
``structured_outputs``). At most one may be asked for."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.errors import EngineRejected, EngineUnsupported

ANY_OBJECT: dict[str, Any] = {"type": "object"}
FIELDS = ("response_format", "guided_json", "guided_choice", "guided_regex", "structured_outputs")


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # "json" | "choice" | "regex"
    value: Any  # a schema, a list of strings, a pattern


def _schema(value: Any, name: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise EngineRejected(f"{name} is not valid JSON") from None
    if not isinstance(value, dict):
        raise EngineRejected(f"{name} must be a JSON schema object")
    return value


def _choices(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise EngineRejected(f"{name} must be a non-empty list of strings")
    return list(value)


def _response_format(fmt: Any) -> Constraint | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json", ANY_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        return Constraint("json", _schema(spec.get("schema", ANY_OBJECT), "response_format"))
    raise EngineRejected(f"response_format type {kind!r} is not supported")


def _structured_outputs(opts: Any, dialect: str) -> Constraint:
    if not isinstance(opts, dict):
        raise EngineRejected("structured_outputs must be an object")
    known = {k: v for k, v in opts.items() if v not in (None, False)}
    if len(known) != 1:
        raise EngineRejected("structured_outputs takes exactly one option")
    ((key, value),) = known.items()
    if key == "json":
        return Constraint("json", _schema(value, "structured_outputs.json"))
    if key == "json_object":
        return Constraint("json", ANY_OBJECT)
    if key == "choice":
        return Constraint("choice", _choices(value, "structured_outputs.choice"))
    if key == "regex" and isinstance(value, str):
        return Constraint("regex", value)
    raise EngineUnsupported(f"{dialect} cannot follow structured_outputs.{key}")


def constraint(body: Mapping[str, Any], dialect: str) -> Constraint | None:
    found: list[Constraint] = []
    if body.get("response_format") is not None:
        c = _response_format(body["response_format"])
        if c is not None:
            found.append(c)
    if body.get("guided_json") is not None:
        found.append(Constraint("json", _schema(body["guided_json"], "guided_json")))
    if body.get("guided_choice") is not None:
        found.append(Constraint("choice", _choices(body["guided_choice"], "guided_choice")))
    if isinstance(body.get("guided_regex"), str):
        found.append(Constraint("regex", body["guided_regex"]))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"], dialect))
    if len(found) > 1:
        raise EngineRejected("only one kind of structured output may be requested")
    return found[0] if found else None

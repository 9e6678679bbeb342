"""Tool definitions and the registry.

A :class:`Tool` is a name, a description, a JSON Schema (Draft 2020-12) for its
arguments, a :class:`Tier`, a timeout, and where it runs: :class:`InProcess`
(an async callable) or :class:`Remote` (a NATS subject served by any process,
see ``tools.remote``). A tool may offer ``reconcile(key)``: "did the effect with
this idempotency key happen?" (an :class:`~tools.wire.Outcome` if it did, ``None``
if it did not; raise if it cannot tell).

Definitions are checked when constructed: a bad name or an invalid schema fails
at start-up, never in front of a model.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import jsonschema  # type: ignore[import-untyped]
from jsonschema import Draft202012Validator

from streams.ids import is_safe_id
from tools.errors import DuplicateToolError, ToolDefinitionError, UnknownToolError
from tools.wire import Outcome, ToolContext

ToolFn = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]
"""An in-process tool: ``async def fn(args, ctx) -> JSON-able result``. Raise
:class:`~tools.errors.ToolFailure` for a definite failure the model should see."""

Reconcile = Callable[[str], Awaitable[Outcome | None]]
"""``async def reconcile(key) -> Outcome | None``: the outcome of the effect with
that idempotency key if it happened, ``None`` if it did not; raise if unknown."""

_SUBJECT = re.compile(r"^[^\s*>.]+(\.[^\s*>.]+)*$")  # a concrete subject: no wildcards


class Tier(StrEnum):
    READ_ONLY = "read_only"  # no effect: run freely, retried freely
    SIDE_EFFECTING = "side_effecting"  # goes through the effect ledger
    REQUIRES_APPROVAL = "requires_approval"  # a human approves first; then as side-effecting


@dataclass(frozen=True)
class InProcess:
    fn: ToolFn


@dataclass(frozen=True)
class Remote:
    """A tool served on a NATS subject (``tools.remote.serve_tool`` or any
    NATS service in any language). ``reconcile=True``: the service also answers
    reconcile requests on ``<subject>.reconcile``."""

    subject: str
    reconcile: bool = False

    def __post_init__(self) -> None:
        if not _SUBJECT.match(self.subject):
            raise ToolDefinitionError(f"invalid remote tool subject: {self.subject!r}")

    @property
    def reconcile_subject(self) -> str:
        return reconcile_subject(self.subject)


def reconcile_subject(subject: str) -> str:
    return f"{subject}.reconcile"


Runs = InProcess | Remote


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON Schema (2020-12) of the arguments object
    runs: Runs
    tier: Tier = Tier.READ_ONLY
    timeout_s: float = 10.0
    reconcile: Reconcile | None = None  # in-process reconciler (remote: Remote.reconcile)
    _validator: Draft202012Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_safe_id(self.name):  # OpenAI function names: the same rule
            raise ToolDefinitionError(f"invalid tool name {self.name!r}: 1-64 of A-Z a-z 0-9 _ -")
        if not self.timeout_s > 0:
            raise ToolDefinitionError(f"tool {self.name}: timeout_s must be > 0")
        object.__setattr__(self, "tier", Tier(self.tier))
        schema = dict(self.parameters)
        try:
            Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ToolDefinitionError(
                f"tool {self.name}: invalid JSON Schema: {exc.message} "
                f"at {_json_path(exc.absolute_path)}"
            ) from exc
        if schema.get("type") != "object":
            # Function-calling APIs pass arguments as one JSON object.
            raise ToolDefinitionError(f'tool {self.name}: parameters must have "type": "object"')
        if isinstance(self.runs, Remote) and self.reconcile is not None:
            raise ToolDefinitionError(
                f"tool {self.name}: a remote tool reconciles remotely (Remote(reconcile=True))"
            )
        validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        object.__setattr__(self, "parameters", schema)
        object.__setattr__(self, "_validator", validator)

    @property
    def effectful(self) -> bool:
        """Goes through the effect ledger (side-effecting and approval tiers)."""
        return self.tier is not Tier.READ_ONLY

    @property
    def has_reconcile(self) -> bool:
        return self.reconcile is not None or (isinstance(self.runs, Remote) and self.runs.reconcile)

    def validation_errors(self, args: Any) -> list[str]:
        """Readable schema violations of ``args``, each prefixed by its JSON path."""
        errors = sorted(self._validator.iter_errors(args), key=lambda e: list(e.absolute_path))
        return [f"{_json_path(e.absolute_path)}: {e.message}" for e in errors]

    def openai_spec(self) -> dict[str, Any]:
        """The OpenAI ``tools=[...]`` entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def _json_path(path: Iterable[str | int]) -> str:
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


class Registry:
    """The tools a process knows, by name."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, tool: Tool) -> Tool:
        """Add ``tool``; registering the same definition again is a no-op, a
        different one under a taken name is a :class:`DuplicateToolError`."""
        have = self._tools.get(tool.name)
        if have is not None and have != tool:
            raise DuplicateToolError(f"tool {tool.name} is already registered")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise UnknownToolError(f"unknown tool: {name}") from None

    def find(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def list(self) -> list[Tool]:
        return sorted(self._tools.values(), key=lambda t: t.name)

    def names(self) -> set[str]:
        return set(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self.list())

    def __len__(self) -> int:
        return len(self._tools)

    def openai_tools(self, names: Iterable[str] | None = None) -> builtins.list[dict[str, Any]]:
        """OpenAI ``tools=[...]`` for ``names`` (all tools when None), in the
        given order. An unknown name raises :class:`UnknownToolError`."""
        chosen = self.list() if names is None else [self.get(n) for n in dict.fromkeys(names)]
        return [t.openai_spec() for t in chosen]

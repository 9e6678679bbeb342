"""Messages of the tool runtime: frozen msgspec Structs, JSON on the wire and in KV.

- :class:`ToolContext`: what a tool learns about the call (idempotency key, run,
  step, call id, trace, deadline); sent to remote tools inside :class:`RemoteCall`.
- :class:`Outcome`: the settled result of one call, as recorded in the effect
  ledger and as answered by a tool's ``reconcile(key)``.
- :class:`ToolResult` | :class:`NeedsApproval`: what ``ToolDispatcher.call`` returns.
- :class:`EffectEntry`: one value of the effect-ledger KV bucket.

Remote tools speak plain JSON (any language can serve one):

- call, on the tool's subject: ``{"args": {...}, "ctx": {...}}`` ->
  ``{"result": <json>}`` or ``{"error": "...", "retryable": bool}``
- reconcile, on ``<subject>.reconcile``: ``{"key": "..."}`` ->
  ``{"done": false}``, ``{"done": true, "outcome": {"result": ...}}`` (or an
  ``outcome`` with ``error``/``retryable``), or ``{"error": "..."}`` (cannot tell).

Schema evolution: a new field must have a default, so older peers keep decoding.
Encoders and decoders are built once, here.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec


def idempotency_key(run_id: str, step: int, call_id: str) -> str:
    """The idempotency key of one tool call: (run, step, call)."""
    return f"{run_id}/{step}/{call_id}"


class ToolContext(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-call context handed to a tool (in-process) or sent with it (remote).

    ``key`` defaults to :func:`idempotency_key` of (run_id, step, call_id); a
    side-effecting tool should make its effect idempotent on it. ``deadline``
    is absolute unix seconds (0: none) and caps the tool's own timeout.
    """

    run_id: str
    step: int
    call_id: str
    key: str = ""
    traceparent: str = ""
    deadline: float = 0.0
    tenant: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            msgspec.structs.force_setattr(
                self, "key", idempotency_key(self.run_id, self.step, self.call_id)
            )


class Outcome(msgspec.Struct, frozen=True, omit_defaults=True):
    """The settled result of a call: ``result`` on success, else ``error``."""

    result: Any = None
    error: str = ""
    retryable: bool = False

    @property
    def ok(self) -> bool:
        return not self.error

    @classmethod
    def success(cls, result: Any) -> Outcome:
        return cls(result=result)

    @classmethod
    def failure(cls, error: str, retryable: bool = False) -> Outcome:
        return cls(error=error, retryable=retryable)


ResultStatus = Literal["ok", "error", "ambiguous"]
# Where a result came from: refused before running, ran now, replayed from the
# ledger (first outcome), answered by the tool's reconcile(key).
ResultSource = Literal["dispatcher", "run", "ledger", "reconciled"]

AMBIGUOUS_MESSAGE = "the effect may have happened; awaiting reconciliation"


class ToolResult(msgspec.Struct, frozen=True, tag="tool_result", kw_only=True, omit_defaults=True):
    """What the model gets back for one tool call (use :meth:`content`).

    ``status == "ambiguous"``: a side effect may or may not have happened and no
    outcome is recorded; the executor must not continue the run as if it had
    failed (nor run it again): it parks the run as ``ambiguous`` until an
    operator or a reconciler settles the key (``EffectLedger.resolve``).
    """

    call_id: str
    tool: str
    status: ResultStatus
    result: Any = None
    error: str = ""
    retryable: bool = False
    source: ResultSource = "run"
    key: str = ""
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def payload(self) -> Any:
        """The JSON value for the model: the result, or ``{error, retryable}``."""
        if self.status == "ok":
            return self.result
        return {"error": self.error, "retryable": self.retryable}

    def content(self) -> str:
        """The ``content`` of the ``role: tool`` message for this call."""
        return _encoder.encode(self.payload()).decode()


class NeedsApproval(msgspec.Struct, frozen=True, tag="needs_approval", kw_only=True):
    """The call is valid and authorised but its tier requires a human decision.

    Nothing ran and nothing was recorded. The executor persists this, pauses the
    run, and after an approval calls ``ToolDispatcher.call(..., approved=True)``
    with the same arguments and context (same key).
    """

    call_id: str
    tool: str
    arguments: dict[str, Any]
    key: str
    description: str = ""


DispatchOutcome = ToolResult | NeedsApproval

EffectState = Literal["intent", "done"]


class EffectEntry(msgspec.Struct, frozen=True, tag="effect", kw_only=True, omit_defaults=True):
    """One idempotency key's record in the effect ledger.

    ``state == "intent"``: a caller is running the effect (until ``lease_until``,
    unix seconds) or crashed while doing so. ``"done"``: ``outcome`` is the first
    outcome, returned to every later call with the key.
    """

    key: str
    tool: str
    args_hash: str
    state: EffectState
    intent_at: float
    lease_until: float
    attempt: int = 1
    outcome: Outcome | None = None
    done_at: float = 0.0
    # How the outcome was settled: "run", "reconciled", "resolved" (operator).
    settled_by: str = ""


class RemoteCall(msgspec.Struct, frozen=True):
    args: dict[str, Any]
    ctx: ToolContext


class RemoteReply(msgspec.Struct, frozen=True):
    result: Any = None
    error: str | None = None
    retryable: bool = False


class ReconcileRequest(msgspec.Struct, frozen=True):
    key: str


class ReconcileReply(msgspec.Struct, frozen=True):
    done: bool = False
    outcome: Outcome | None = None
    error: str | None = None


_encoder = msgspec.json.Encoder()
_sorted_encoder = msgspec.json.Encoder(order="sorted")
_entry_decoder = msgspec.json.Decoder(EffectEntry)
_call_decoder = msgspec.json.Decoder(RemoteCall)
_reply_decoder = msgspec.json.Decoder(RemoteReply)
_reconcile_request_decoder = msgspec.json.Decoder(ReconcileRequest)
_reconcile_reply_decoder = msgspec.json.Decoder(ReconcileReply)
_any_decoder = msgspec.json.Decoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode_json(data: bytes | str) -> Any:
    return _any_decoder.decode(data)


def to_json_value(value: Any) -> Any:
    """``value`` as plain JSON data (what a replay from the ledger returns).

    Raises ``TypeError``/``msgspec.EncodeError`` for values JSON cannot hold.
    """
    return _any_decoder.decode(_encoder.encode(value))


def args_hash(args: dict[str, Any]) -> str:
    """A stable digest of call arguments (key order does not matter)."""
    return hashlib.sha256(_sorted_encoder.encode(args)).hexdigest()


def decode_entry(data: bytes) -> EffectEntry:
    return _entry_decoder.decode(data)


def decode_call(data: bytes) -> RemoteCall:
    return _call_decoder.decode(data)


def decode_reply(data: bytes) -> RemoteReply:
    return _reply_decoder.decode(data)


def decode_reconcile_request(data: bytes) -> ReconcileRequest:
    return _reconcile_request_decoder.decode(data)


def decode_reconcile_reply(data: bytes) -> ReconcileReply:
    return _reconcile_reply_decoder.decode(data)


def encode_reply(outcome: Outcome) -> bytes:
    """A remote tool's reply: exactly ``{"result"}`` or ``{"error", "retryable"}``."""
    if outcome.ok:
        return _encoder.encode({"result": outcome.result})
    return _encoder.encode({"error": outcome.error, "retryable": outcome.retryable})

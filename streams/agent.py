"""Wire types of agent runs: frozen, tagged msgspec Structs, JSON in KV and on NATS.

- :class:`Run`: the durable record of one run, one value of the ``JETSERVE_RUNS``
  KV bucket under the run id. It holds the conversation: runs are the one route
  where storing text is the point, so text lives here (and in run events), never
  in metrics, logs or the request ledger.
- :class:`StepMsg` on ``jetserve.agent.step`` (work queue ``JETSERVE_AGENT``): a
  nudge "look at run R at step N". The record says what to do; the message only
  says when. ``Nats-Msg-Id`` = :func:`step_msg_id`, so a step is enqueued once.
- :class:`SettleMsg` on ``jetserve.agent.settle``: a root run ended, charge it.
- :class:`RunEvent` on ``jetserve.run.<tenant>.<run>`` (captured by
  ``JETSERVE_RUN_EVENTS``): status changes and messages, for resumable SSE.
- :class:`ApprovalDecision`, :class:`CancelRequest`, :class:`LeaseRecord`: the
  other values of the bucket (``<run>.approval.<call>``, ``<run>.cancel``,
  ``<run>.lease``).

Schema evolution: a new field must have a default, so older peers keep decoding.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from typing import Any, Literal

import msgspec

from streams.ids import is_safe_id
from streams.wire import Usage

RunStatus = Literal[
    "queued",
    "running",
    "awaiting_approval",
    "awaiting_child",
    "completed",
    "failed",
    "cancelled",
    "ambiguous",
    "budget_exceeded",
    "deadline_exceeded",
]
# A run in one of these never changes again. ``ambiguous`` is one: the run stops
# with the unsettled effect's key named in ``ambiguous_key``; settling that key
# (EffectLedger.resolve) is an operator's reconciliation of the effect, not a resume.
TERMINAL: frozenset[str] = frozenset(
    {"completed", "failed", "cancelled", "ambiguous", "budget_exceeded", "deadline_exceeded"}
)
# Parked: nothing to do until a decision, a child, a cancel or the deadline.
PARKED: frozenset[str] = frozenset({"awaiting_approval", "awaiting_child"})

SPAWN_TOOL = "spawn_agent"  # the built-in tool that starts a child run


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """Limits of a run, or amounts carved from them. Money in integer micro-USD."""

    max_steps: int = 16  # model calls
    max_tokens: int = 32_000  # prompt + completion tokens over all model calls
    max_cost_micros: int = 0

    def plus(self, other: Budget) -> Budget:
        return Budget(
            max_steps=self.max_steps + other.max_steps,
            max_tokens=self.max_tokens + other.max_tokens,
            max_cost_micros=self.max_cost_micros + other.max_cost_micros,
        )

    def minus(self, other: Budget) -> Budget:
        return Budget(
            max_steps=self.max_steps - other.max_steps,
            max_tokens=self.max_tokens - other.max_tokens,
            max_cost_micros=self.max_cost_micros - other.max_cost_micros,
        )

    def fits_in(self, other: Budget) -> bool:
        return (
            self.max_steps <= other.max_steps
            and self.max_tokens <= other.max_tokens
            and self.max_cost_micros <= other.max_cost_micros
        )


NO_BUDGET = Budget(max_steps=0, max_tokens=0, max_cost_micros=0)


class Spend(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a run used: model calls, tokens and their cost."""

    steps: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_micros: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: Spend) -> Spend:
        return Spend(
            steps=self.steps + other.steps,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            cost_micros=self.cost_micros + other.cost_micros,
        )

    def as_budget(self) -> Budget:
        return Budget(
            max_steps=self.steps, max_tokens=self.tokens, max_cost_micros=self.cost_micros
        )

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


class RunPrice(msgspec.Struct, frozen=True, kw_only=True):
    """The route's price, fixed when the run is created (executors never read the
    gateway's price book). Same arithmetic as ``gateway.tenancy.pricing.Price.cost``:
    integer micro-USD per 1000 tokens, rounded up."""

    version: str = "v1"
    input_per_1k: int = 100
    output_per_1k: int = 300
    cached_per_1k: int | None = None

    def cost(self, usage: Usage) -> int:
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        cached_rate = self.input_per_1k if self.cached_per_1k is None else self.cached_per_1k
        units = (
            (usage.prompt_tokens - cached) * self.input_per_1k
            + cached * cached_rate
            + usage.completion_tokens * self.output_per_1k
        )
        return -(-units // 1000)


class ModelCall(msgspec.Struct, frozen=True, kw_only=True):
    """The model call of the current step, recorded before it is published: after
    a crash the next owner re-publishes the same request id (JetStream dedupes it)
    and reads its frames from the capture, so the call is made and charged once."""

    request_id: str
    step: int
    attempt: int = 1
    started: float = 0.0


class PendingApproval(msgspec.Struct, frozen=True, kw_only=True):
    call_id: str
    tool: str
    arguments: dict[str, Any]
    key: str  # the call's idempotency key: the same after approval
    description: str = ""
    asked_at: float = 0.0


class PendingChild(msgspec.Struct, frozen=True, kw_only=True):
    """A ``spawn_agent`` call waiting for its child run. Everything needed to
    (re)create the child is here, so a crash between carving and creating is
    repaired by the next owner."""

    call_id: str
    child_id: str
    task: str
    tools: tuple[str, ...]
    budget: Budget
    deadline: float


class Run(msgspec.Struct, frozen=True, kw_only=True, tag="run"):
    id: str
    tenant: str
    model: str
    deadline: float  # absolute unix seconds; never extended
    budget: Budget
    price: RunPrice = RunPrice()
    org: str = ""
    key_id: str = ""
    # The creating key's party across rotations (its lineage's first key id):
    # a rotated key of the creator may not approve the run either.
    key_party: str = ""
    parent: str = ""  # "" for a root run
    root: str = ""  # the root of the tree ("" = this run)
    ancestors: tuple[str, ...] = ()  # parent first; a cancel of any of them cancels this run
    depth: int = 0
    parent_step: int = 0  # the parent's step that spawned this run
    parent_call: str = ""  # the parent's tool call id
    plan_version: str = "1"
    tools: tuple[str, ...] = ()  # the run's tool authority
    status: RunStatus = "queued"
    reason: str = ""  # why it failed/halted; "" otherwise
    result: str | None = None  # the final answer of a completed run
    messages: list[dict[str, Any]] = []
    step: int = 0  # steps done: a step is one model call and the tool calls it made
    spent: Spend = Spend()  # this run's own model calls
    children_spent: Spend = Spend()  # what finished children spent (their trees included)
    carved: Budget = NO_BUDGET  # budget held by children still running
    children: tuple[str, ...] = ()
    model_call: ModelCall | None = None
    pending_approval: PendingApproval | None = None
    # Every decision on this run's gated calls, with the key that made it (the
    # audit trail; the store's create-only decision is what the executor obeys).
    approvals: tuple[ApprovalDecision, ...] = ()
    pending_child: PendingChild | None = None
    ambiguous_key: str = ""  # the effect whose outcome nobody can tell
    traceparent: str = ""
    created: float = 0.0
    updated: float = 0.0
    step_started: float = 0.0  # when the current step's owner began it (stuck detection)
    events_through: int = 0  # messages[:events_through] have had their events published
    status_seq: int = 0  # bumped on every status change: the id of its status event

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def root_id(self) -> str:
        return self.root or self.id

    def used(self) -> Budget:
        """Everything charged against this run's budget: its own spend, finished
        children's spend, and what running children hold."""
        return self.spent.plus(self.children_spent).as_budget().plus(self.carved)

    def remaining(self) -> Budget:
        return self.budget.minus(self.used())


class StepMsg(msgspec.Struct, frozen=True, tag="step", omit_defaults=True):
    run_id: str
    step: int
    reason: str = "next"  # start | next | approval | child | cancel | retry (for humans)


class SettleMsg(msgspec.Struct, frozen=True, tag="settle"):
    run_id: str


EventKind = Literal["status", "message"]


class RunEvent(msgspec.Struct, frozen=True, kw_only=True, tag="run_event", omit_defaults=True):
    """``status``: the run's status changed (or was re-announced); ``message``: the
    conversation grew by ``message`` at ``index``. Replays after a crash carry the
    same ``index``/``revision``, so a reader can drop a repeat."""

    run_id: str
    kind: EventKind
    status: RunStatus
    step: int
    at: float
    revision: int = 0
    index: int = -1
    message: dict[str, Any] | None = None
    reason: str = ""
    result: str | None = None
    pending_approval: PendingApproval | None = None
    spent: Spend | None = None


class ApprovalDecision(msgspec.Struct, frozen=True, kw_only=True, tag="approval"):
    call_id: str
    approve: bool
    reason: str = ""
    at: float = 0.0
    key_id: str = ""  # the API key that decided
    step: int = 0  # the run's step of the call (models reuse call ids across steps)


class CancelRequest(msgspec.Struct, frozen=True, kw_only=True, tag="cancel"):
    run_id: str
    reason: str = "cancelled by the client"
    at: float = 0.0


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True, tag="lease"):
    owner: str
    until: float  # unix seconds; past it anyone may take the run over


# -- ids ------------------------------------------------------------------------------


def new_run_id() -> str:
    return "run_" + uuid.uuid4().hex[:24]


def run_id_for(tenant: str, idempotency_key: str) -> str:
    """The run id of a client's Idempotency-Key: a retried POST finds its run."""
    return "run_" + hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()[:24]


def child_run_id(parent: str, step: int, call_id: str) -> str:
    """Deterministic, so re-creating a child after a crash finds the same one."""
    return "run_" + hashlib.sha256(f"{parent}/{step}/{call_id}".encode()).hexdigest()[:24]


def is_run_id(value: str) -> bool:
    return value.startswith("run_") and is_safe_id(value)


_DIGEST = re.compile(r"h[0-9a-f]{32}")  # what token() makes of an unsafe value


def token(value: str) -> str:
    """``value`` as one KV key / subject token: itself when safe, else a digest.
    One to one: a safe value shaped like a digest is digested too, so no value
    (a client's tool-call id ``h<32 hex>``) can stand for another's key (an
    approval of ``x.y`` would have approved a hidden call ``h`` + sha256(``x.y``))."""
    if is_safe_id(value) and not _DIGEST.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:32]


def step_msg_id(run_id: str, step: int, suffix: str = "") -> str:
    return f"{run_id}:{step}" + (f":{suffix}" if suffix else "")


def model_request_id(run_id: str, step: int, attempt: int) -> str:
    return f"{run_id}-{step}-{attempt}"


def child_traceparent(traceparent: str) -> str:
    """A new span in the same trace (W3C); a new trace when there is none."""
    parts = traceparent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32:
        return f"00-{parts[1]}-{secrets.token_hex(8)}-{parts[3]}"
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


# -- codecs ---------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
_run_decoder = msgspec.json.Decoder(Run)
_step_decoder = msgspec.json.Decoder(StepMsg)
_settle_decoder = msgspec.json.Decoder(SettleMsg)
_event_decoder = msgspec.json.Decoder(RunEvent)
_approval_decoder = msgspec.json.Decoder(ApprovalDecision)
_cancel_decoder = msgspec.json.Decoder(CancelRequest)
_lease_decoder = msgspec.json.Decoder(LeaseRecord)


def encode(
    msg: Run
    | StepMsg
    | SettleMsg
    | RunEvent
    | ApprovalDecision
    | CancelRequest
    | LeaseRecord
    | dict[str, Any],
) -> bytes:
    return _encoder.encode(msg)


def decode_run(data: bytes) -> Run:
    return _run_decoder.decode(data)


def decode_step(data: bytes) -> StepMsg:
    return _step_decoder.decode(data)


def decode_settle(data: bytes) -> SettleMsg:
    return _settle_decoder.decode(data)


def decode_event(data: bytes) -> RunEvent:
    return _event_decoder.decode(data)


def decode_approval(data: bytes) -> ApprovalDecision:
    return _approval_decoder.decode(data)


def decode_cancel_request(data: bytes) -> CancelRequest:
    return _cancel_decoder.decode(data)


def decode_lease(data: bytes) -> LeaseRecord:
    return _lease_decoder.decode(data)

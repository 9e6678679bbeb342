"""The agent tool runtime: registry with JSON Schemas, dispatcher (validation,
authority, timeouts, approval gates), the effect ledger (idempotency keys), and
remote tools served on NATS. See docs/tools.md."""

from tools.dispatcher import ToolDispatcher, ToolMetrics
from tools.effects import Effect, EffectLedger, EffectLedgerConfig, kv_key
from tools.errors import (
    DispatchConfigError,
    DuplicateToolError,
    EffectLedgerError,
    ToolDefinitionError,
    ToolError,
    ToolFailure,
    UnknownToolError,
)
from tools.registry import InProcess, Reconcile, Registry, Remote, Tier, Tool, ToolFn
from tools.remote import ToolServer, call_remote, reconcile_remote, serve_tool
from tools.wire import (
    EffectEntry,
    NeedsApproval,
    Outcome,
    ToolContext,
    ToolResult,
    args_hash,
    idempotency_key,
)

__all__ = [
    "DispatchConfigError",
    "DuplicateToolError",
    "Effect",
    "EffectEntry",
    "EffectLedger",
    "EffectLedgerConfig",
    "EffectLedgerError",
    "InProcess",
    "NeedsApproval",
    "Outcome",
    "Reconcile",
    "Registry",
    "Remote",
    "Tier",
    "Tool",
    "ToolContext",
    "ToolDefinitionError",
    "ToolDispatcher",
    "ToolError",
    "ToolFailure",
    "ToolFn",
    "ToolMetrics",
    "ToolResult",
    "ToolServer",
    "UnknownToolError",
    "args_hash",
    "call_remote",
    "idempotency_key",
    "kv_key",
    "reconcile_remote",
    "serve_tool",
]

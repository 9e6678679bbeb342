"""The agent tool runtime: registry with JSON Schemas, dispatcher (validation,
authority, timeouts, approval gates), the effect ledger (idempotency keys), and
remote tools served on NATS. See docs/tools.md."""

from tools.dispatcher import Dispatcher, ToolMetrics
from tools.effects import Effect, EffectLedger, LedgerConfig, kv_key
from tools.errors import (
    DispatchConfigError,
    DuplicateToolError,
    LedgerError,
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
    "Dispatcher",
    "DuplicateToolError",
    "Effect",
    "EffectEntry",
    "EffectLedger",
    "InProcess",
    "LedgerConfig",
    "LedgerError",
    "NeedsApproval",
    "Outcome",
    "Reconcile",
    "Registry",
    "Remote",
    "Tier",
    "Tool",
    "ToolContext",
    "ToolDefinitionError",
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

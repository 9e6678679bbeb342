"""Errors of the tool runtime.

JetserveError (streams.errors)   base: ``message``, ``code``, ``retryable``
└── ToolError                    base of the tool runtime
    ├── ToolDefinitionError      a Tool is malformed: bad name, invalid JSON Schema, ...
    │   └── DuplicateToolError   a second, different tool under a registered name
    ├── UnknownToolError         Registry.get / openai_tools of a name never registered
    ├── DispatchConfigError      the dispatcher lacks what a tool needs (a ledger, a NATS client)
    ├── EffectLedgerError        the effect ledger could not be read or written (retryable):
    │                            the outcome is not durable, so the caller must not ack
    ├── ToolFailure              raised BY a tool: a definite failure, nothing (more) to
    │                            reconcile; reported to the model as {error, retryable}
    └── ToolCallError            raised by the invocation layer; the dispatcher turns
        │                        each into a structured result, never lets it escape
        ├── NotDeliveredError    the call never reached the tool (no responders): the
        │                        effect certainly did not happen (retryable)
        └── EffectUnknownError   the call may or may not have taken effect
            ├── ToolTimeoutError the tool did not answer within its timeout / the deadline
            └── ToolCrashedError the tool raised something other than ToolFailure, or a
                                 remote service answered with a 5xx service error

Only ``ToolDefinitionError``/``UnknownToolError`` (programming errors at start-up),
``DispatchConfigError`` and ``EffectLedgerError`` (infrastructure: nack and retry) ever
escape ``ToolDispatcher.call``; every model-facing problem is a ``ToolResult``.
"""

from __future__ import annotations

from streams.errors import JetserveError


class ToolError(JetserveError):
    code = "tool_error"


class ToolDefinitionError(ToolError, ValueError):
    code = "invalid_tool_definition"


class DuplicateToolError(ToolDefinitionError):
    code = "duplicate_tool"


class UnknownToolError(ToolError, KeyError):
    code = "unknown_tool"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class DispatchConfigError(ToolError):
    code = "dispatch_misconfigured"


class EffectLedgerError(ToolError):
    code = "effect_ledger_unavailable"
    retryable = True


class ToolFailure(ToolError):
    """Raise this from a tool to report a definite failure to the model.

    ``retryable`` tells the model whether calling again (as a new call) may
    succeed. For a side-effecting tool it is recorded as the call's outcome:
    a repeat with the same idempotency key returns it without running again.
    """

    code = "tool_failed"

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message, retryable=retryable)


class ToolCallError(ToolError):
    code = "tool_call_failed"


class NotDeliveredError(ToolCallError):
    code = "tool_not_delivered"
    retryable = True


class EffectUnknownError(ToolCallError):
    code = "tool_effect_unknown"
    retryable = True


class ToolTimeoutError(EffectUnknownError):
    code = "tool_timeout"


class ToolCrashedError(EffectUnknownError):
    code = "tool_crashed"
    retryable = False

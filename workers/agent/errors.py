"""Errors of the agent executor.

JetserveError (streams.errors)   base: ``message``, ``code``, ``retryable``
└── AgentError                   base of the agent executor
    ├── ModelCallFailed          the model call ended in an error (``retryable``: a new
    │                            attempt may succeed: interrupted stream, 429/503; the
    │                            step retries only then, workers/agent/step.py)
    ├── StepInterrupted          a cancel notice for the run (or an ancestor) arrived
    │                            while the step waited on the model or a read-only tool
    └── CrashSpecError           a ``--crash-at POINT:PROBABILITY`` that does not parse
"""

from __future__ import annotations

from streams.errors import JetserveError


class AgentError(JetserveError):
    code = "agent_error"


class ModelCallFailed(AgentError):
    code = "model_call_failed"

    def __init__(self, message: str, *, code: str = "model_call_failed", retryable: bool) -> None:
        super().__init__(message, code=code, retryable=retryable)  # each caller decides


class StepInterrupted(AgentError):
    code = "step_interrupted"


class CrashSpecError(AgentError, ValueError):
    code = "invalid_crash_spec"

"""The agent run executor: a durable JetStream consumer that advances agent runs
one step at a time (model call through the inference subjects, tool calls
through ``tools``), with a lease per run, acks only after outcomes are durable,
sub-agents, and crash injection for the crash matrix. See docs/agents.md."""

from workers.agent.config import ExecutorConfig
from workers.agent.crash import POINTS, CrashPoints, parse_crash_specs
from workers.agent.executor import Executor

__all__ = ["POINTS", "CrashPoints", "Executor", "ExecutorConfig", "parse_crash_specs"]

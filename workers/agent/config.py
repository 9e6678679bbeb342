"""Executor settings: one immutable object (no globals)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from streams.agent_topology import DEFAULT_AGENT, AgentTopology
from streams.connect import OPEN, BusAuth
from streams.definitions import DEFAULT_TOPOLOGY, Topology

StuckPolicy = Literal["fail", "retry"]


@dataclass(frozen=True)
class ExecutorConfig:
    nats_url: str
    nats_auth: BusAuth = OPEN  # the agent role's credential; OPEN only with --insecure
    executor_id: str = field(default_factory=lambda: f"ex-{uuid.uuid4().hex[:10]}")
    concurrency: int = 64  # steps in flight in this process
    # One owner per run: the lease lasts this long and is renewed every third of
    # it (with in_progress() on the step message) while the step runs.
    lease_s: float = 5.0
    # Stuck-step detection: a step running longer than this is far past any
    # expected duration (a model call is bounded by its deadline, a tool by its
    # timeout). "fail": the run fails with the reason; "retry": the step goes
    # back to the queue for another executor, up to ``stuck_retries`` times,
    # then the run fails.
    step_timeout_s: float = 300.0
    stuck_policy: StuckPolicy = "fail"
    stuck_retries: int = 2
    # After the first token, this long without a frame means the worker died.
    heartbeat_timeout_s: float = 5.0
    model_attempts: int = 3  # per step: a new request id after a retryable failure
    step_max_tokens: int = 1024  # max_tokens of one model call (capped by the budget)
    max_depth: int = 3  # sub-agent nesting
    poll_s: float = 1.0  # long-poll expiry of one pull
    drain_timeout_s: float = 10.0
    agent: AgentTopology = DEFAULT_AGENT
    topology: Topology = DEFAULT_TOPOLOGY  # the inference work queue (class "agent")

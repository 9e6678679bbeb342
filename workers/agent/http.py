"""The executor's probe surface: /metrics, /healthz, /readyz (connected to NATS
and serving). The same small server as a worker's (``workers.probe``)."""

from __future__ import annotations

from workers.agent.executor import Executor
from workers.probe import _Server, probe_server


def server(executor: Executor, host: str, port: int) -> _Server:
    def checks() -> dict[str, bool]:
        return {"nats": executor.connected, "serving": executor.ready.is_set()}

    return probe_server(executor.metrics.registry, checks, host, port)
